// CSystemd — libsystemd (libsystemd-dev), for the Systemd module.
#include <sys/uio.h>
#include <systemd/sd-daemon.h>
#include <systemd/sd-journal.h>
