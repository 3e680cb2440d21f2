// CLinux — see include/CLinux.h.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sched.h>
#include "CLinux.h"

int obs_file_identity_of(int fd, obs_file_identity *out) {
    memset(out, 0, sizeof *out);
#ifdef STATX_BTIME
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_INO | STATX_BTIME, &st) == 0) {
        out->inode = st.stx_ino;
        if (st.stx_mask & STATX_BTIME) {
            out->birth_seconds = st.stx_btime.tv_sec;
            out->birth_nanoseconds = st.stx_btime.tv_nsec;
            out->has_birth = 1;
        }
        return 0;
    }
    if (errno != ENOSYS) return -1;
#endif
    struct stat plain;
    if (fstat(fd, &plain) != 0) return -1;
    out->inode = plain.st_ino;
    return 0;
}

int obs_cpus_allowed(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
    return CPU_COUNT(&set);
}

#if defined(__x86_64__)
#include <nmmintrin.h>

int obs_crc32c_hardware(void) { return __builtin_cpu_supports("sse4.2") ? 1 : 0; }

__attribute__((target("sse4.2")))
uint32_t obs_crc32c_update(uint32_t crc, const void *bytes, size_t count) {
    const unsigned char *p = bytes;
    uint64_t c = crc;
    while (count >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        count -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (count-- > 0) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
#else
int obs_crc32c_hardware(void) { return 0; }

uint32_t obs_crc32c_update(uint32_t crc, const void *bytes, size_t count) {
    (void)bytes;
    (void)count;
    return crc;
}
#endif

#include <sys/socket.h>

int obs_accept(int listener) {
    return accept4(listener, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
}

long obs_send(int fd, const void *bytes, unsigned long count) {
    return send(fd, bytes, count, MSG_NOSIGNAL);
}

int obs_peer_credentials(int fd, uint32_t *uid, uint32_t *gid, int32_t *pid) {
    struct ucred cred;
    socklen_t length = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) return -1;
    *uid = cred.uid;
    *gid = cred.gid;
    *pid = cred.pid;
    return 0;
}

int obs_start_writeback(int fd, int64_t offset, int64_t count) {
    return sync_file_range(fd, (off64_t)offset, (off64_t)count, SYNC_FILE_RANGE_WRITE);
}
