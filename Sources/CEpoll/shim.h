// CEpoll — <sys/epoll.h> for obsbench's raw event loop: Swift's Glibc module leaves it out.
#pragma once
#include <sys/epoll.h>
