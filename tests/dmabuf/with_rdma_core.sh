#!/bin/sh
# Runs a dmabuf test against the rdma-core whose rxe provider has dma-buf MRs,
# where tests/vm built one (tests/vm/rdma-core names its lib/ in RDMAX_DMABUF_LIBS);
# elsewhere against the installed rdma-core (a NIC's provider has them).
if [ -n "${RDMAX_DMABUF_LIBS:-}" ]; then
    LD_LIBRARY_PATH=$RDMAX_DMABUF_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
fi
exec "$@"
