/* A per-thread scratch buffer, grown as needed and kept for the thread's next call: each file
 * that includes this header has its own (the kernels that use one do not nest). */
#ifndef CBGEN_THREAD_BUFFER_H
#define CBGEN_THREAD_BUFFER_H

#include <stdint.h>
#include <stdlib.h>

/* At least `bytes` bytes, 64-byte aligned; 0 when there is no memory for them. */
static inline void *thread_buffer(int64_t bytes) {
    static __thread void *buf;
    static __thread int64_t cap;
    if (cap < bytes) {
        void *p;
        if (posix_memalign(&p, 64, (size_t)bytes)) return 0;
        free(buf);
        buf = p;
        cap = bytes;
    }
    return buf;
}

#endif
