// The headers-alone check is its compilation (one translation unit a public
// header, each including only that header); running it only says it built.
#include <cstdio>

int main() {
    std::puts("every public header compiles alone");
    return 0;
}
