/* bench_net.h - the free-port probe of the multi-process benchmarks (rpc_bench_util.h,
 * collectives, rpc_scale). Header-only: every C file under bench/ becomes a program.
 *
 *   bench_free_port()  a TCP port on 127.0.0.1 that was free a moment ago, or -1
 */
#ifndef TD_BENCH_NET_H
#define TD_BENCH_NET_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static inline int bench_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  int port = -1;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
    port = ntohs(sa.sin_port);
  close(fd);
  return port;
}

#endif
