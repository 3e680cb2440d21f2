// CFileIdentity — which file an open descriptor is: its inode and, where the file system
// records it, its birth time (statx, which Swift's Glibc module does not export). A copy of
// a file — a restored backup — has another birth time even when it reuses the inode number.
#pragma once
#include <stdint.h>

typedef struct {
    uint64_t inode;
    int64_t birth_seconds;
    uint32_t birth_nanoseconds;
    /// 1 when the birth time is known.
    int has_birth;
} obs_file_identity;

/// Fills `out` for the open file `fd`; 0 on success, else -1 with errno set.
int obs_file_identity_of(int fd, obs_file_identity *out);
