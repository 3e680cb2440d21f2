// CLinux — Linux facts that Swift's Glibc module does not export (they need _GNU_SOURCE), and
// the one CPU instruction the store wants that Swift cannot name (CRC-32C).
#pragma once
#include <stdint.h>

// Which file an open descriptor is: its inode and, where the file system records it, its
// birth time (statx). A copy of a file — a restored backup — has another birth time even
// when it reuses the inode number.

typedef struct {
    uint64_t inode;
    int64_t birth_seconds;
    uint32_t birth_nanoseconds;
    /// 1 when the birth time is known.
    int has_birth;
} obs_file_identity;

/// Fills `out` for the open file `fd`; 0 on success, else -1 with errno set.
int obs_file_identity_of(int fd, obs_file_identity *out);

/// How many CPUs this process may run on (sched_getaffinity: taskset, CPUAffinity=), or -1.
int obs_cpus_allowed(void);

// CRC-32C on the CPU's own instruction (SSE 4.2), where it has one: the store checksums every
// record of its log and every block of its snapshot (ObsStore's CRC32C falls back to tables).
#include <stddef.h>

/// 1 when `obs_crc32c_update` may be called (x86-64 with SSE 4.2), else 0.
int obs_crc32c_hardware(void);

/// Runs the CRC-32C register `crc` (already inverted, as the algorithm keeps it) over `bytes`.
uint32_t obs_crc32c_update(uint32_t crc, const void *bytes, size_t count);

// The daemon's event loop (ObsServer's IOLoop): epoll and eventfd, which Swift's Glibc module
// leaves out, and the socket calls it makes with flags that need _GNU_SOURCE.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>

/// accept4 with SOCK_NONBLOCK | SOCK_CLOEXEC: the new descriptor, or -1 with errno set.
int obs_accept(int listener);

/// send with MSG_NOSIGNAL (a closed peer is EPIPE, never SIGPIPE): bytes sent, or -1.
long obs_send(int fd, const void *bytes, unsigned long count);

/// The peer credentials of a Unix socket (SO_PEERCRED); 0 on success, else -1 with errno set.
int obs_peer_credentials(int fd, uint32_t *uid, uint32_t *gid, int32_t *pid);

// The write-ahead log's zeros ahead of its end (WriteAheadLog.zeroAhead).

/// Starts writing back `count` bytes of `fd` from `offset` without waiting
/// (sync_file_range with SYNC_FILE_RANGE_WRITE); 0, or -1 with errno set.
int obs_start_writeback(int fd, int64_t offset, int64_t count);
