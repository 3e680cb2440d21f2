// ObsServer — how many event loops the daemon runs: one per CPU it may actually use.
//
// NIO's `System.coreCount` honours cgroup quotas and cpusets but not the process's CPU
// affinity (`taskset`, systemd's `CPUAffinity=`); a daemon pinned to one CPU that ran two
// loops there would hand every fan-out from one thread to another on the same core. The
// count is the smaller of the two; `server.threads` overrides it.

import CLinux
import NIOCore

enum EventLoops {
    /// The number of loops, and what decided it (for the log).
    static func sized() -> (count: Int, reason: String) {
        let quota = System.coreCount
        let allowed = Int(obs_cpus_allowed())
        if allowed > 0, allowed < quota { return (allowed, "CPU affinity (\(allowed) of \(quota) CPUs)") }
        return (max(1, quota), "CPUs available to the process (cgroup quota and cpuset honoured)")
    }
}
