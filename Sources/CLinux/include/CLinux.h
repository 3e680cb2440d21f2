// CLinux — Linux facts that Swift's Glibc module does not export (they need _GNU_SOURCE).
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
