/* mpi_allreduce_bench: MPI_Allreduce (sum of floats, in place) timed as
 * rdmax_team_bench times rdmax's node-local allreduce: each call a barrier,
 * then the allreduce, timed on rank 0; every element of every result
 * checked on every rank, outside the timing. Built by
 * examples/bench/allreduce-vs-mpi with Debian's mpicc (not by Meson: MPI is
 * the baseline here, not a dependency).
 *
 *   mpirun -n 2 mpi_allreduce_bench [-s MIN] [-S MAX] [-i ITERS] [--json FILE]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float value(int rank, size_t i, int iter) {
    return (float)(rank + 1) + (float)((i + (size_t)iter) % 1024);
}

static int by_value(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(int argc, char** argv) {
    size_t min = 4096, max = 256 * 1024;
    int iters = 200, rank = 0, ranks = 1;
    const char* json = NULL;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    for (int a = 1; a + 1 < argc; a += 2) {
        if (strcmp(argv[a], "-s") == 0)
            min = strtoull(argv[a + 1], NULL, 0);
        else if (strcmp(argv[a], "-S") == 0)
            max = strtoull(argv[a + 1], NULL, 0);
        else if (strcmp(argv[a], "-i") == 0)
            iters = atoi(argv[a + 1]);
        else if (strcmp(argv[a], "--json") == 0)
            json = argv[a + 1];
        else {
            fprintf(stderr, "mpi_allreduce_bench: unknown option %s\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    FILE* out = rank == 0 && json ? fopen(json, "w") : NULL;
    if (rank == 0)
        printf("%9s %5s %12s %10s %10s  MPI_Allreduce\n", "bytes", "ranks", "median[us]", "p10[us]",
               "p90[us]");
    double* us = malloc(sizeof(double) * (size_t)(iters > 0 ? iters : 1));
    for (size_t b = min; b <= max; b *= 2) {
        const size_t n = b / sizeof(float);
        float* v = malloc(n * sizeof(float));
        for (int it = -5; it < iters; ++it) {
            for (size_t i = 0; i < n; ++i)
                v[i] = value(rank, i, it);
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, v, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            const double t1 = MPI_Wtime();
            for (size_t i = 0; i < n; ++i) {
                float want = 0;
                for (int r = 0; r < ranks; ++r)
                    want += value(r, i, it);
                if (v[i] != want) {
                    fprintf(stderr, "rank %d: %zu B, call %d: element %zu is %g, expected %g\n",
                            rank, b, it, i, (double)v[i], (double)want);
                    MPI_Abort(MPI_COMM_WORLD, 1);
                }
            }
            if (it >= 0)
                us[it] = (t1 - t0) * 1e6;
        }
        free(v);
        if (rank != 0)
            continue;
        qsort(us, (size_t)iters, sizeof(double), by_value);
        const double med = us[(iters - 1) / 2], p10 = us[(iters - 1) / 10],
                     p90 = us[(size_t)(0.9 * (iters - 1))];
        printf("%9zu %5d %12.2f %10.2f %10.2f\n", b, ranks, med, p10, p90);
        fflush(stdout);
        if (out)
            fprintf(out, "{\"bytes\":%zu,\"ranks\":%d,\"impl\":\"mpi\",\"median_us\":%.3f}\n", b,
                    ranks, med);
    }
    if (out)
        fclose(out);
    free(us);
    MPI_Finalize();
    return 0;
}
