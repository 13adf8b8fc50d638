/* LD_PRELOAD shim used by `tfdist launch --bind=loopback` (the default).
 *
 * TensorFlow's gRPC server (the one every tf.distribute worker starts) always listens on every
 * interface, "0.0.0.0:<port>" (gRPC makes that a dual-stack [::] socket), whatever address the
 * cluster spec gives: tensorflow/tensorflow#2925, unchanged in TF 2.21. A local cluster must not
 * be reachable from the network, so this turns a bind to the IPv4 or IPv6 wildcard address into
 * a bind to 127.0.0.1 (::ffff:127.0.0.1 on a dual-stack socket), which is what the workers dial.
 * Every other bind passes through unchanged.
 *
 * TFDIST_BIND_ADDRESS=<IPv4 address> binds the wildcard to that address instead: a worker on a
 * host with several interfaces (tools/netcluster.py's namespaces) listens on its own address only.
 * TFDIST_BIND_INTERFACE=<name> does the same with the address of that interface (mpirun's ranks,
 * which all get the same environment).
 *
 * TFDIST_BIND=all leaves every bind alone, read at each bind: a process that has the shim loaded
 * (preloaded at its start) passes wildcard binds through while the variable says so. `tfdist
 * launch` sets TFDIST_BIND for its processes (loopback or all, its --bind); the tests preload the
 * shim into every process they start with TFDIST_BIND=all, so that a launch's agent can be a fork
 * of the launcher, which they start warm (tfdist/launch/warm.py).
 *
 * Built on first use by launchers/local.py:  cc -shared -fPIC -O2 -o loopback_bind.so loopback_bind.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

/* The address wildcard binds go to (network byte order): TFDIST_BIND_ADDRESS, else the IPv4
 * address of the interface TFDIST_BIND_INTERFACE (one setting for every host, as under mpirun's
 * -x), else 127.0.0.1. */
static in_addr_t target(void) {
  const char *given = getenv("TFDIST_BIND_ADDRESS");
  const char *iface = getenv("TFDIST_BIND_INTERFACE");
  struct in_addr a;
  if (given && inet_pton(AF_INET, given, &a) == 1) return a.s_addr;
  if (iface) {
    struct ifaddrs *all, *i;
    in_addr_t found = htonl(INADDR_LOOPBACK);
    if (getifaddrs(&all) == 0) {
      for (i = all; i; i = i->ifa_next) {
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && strcmp(i->ifa_name, iface) == 0) {
          found = ((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr;
          break;
        }
      }
      freeifaddrs(all);
    }
    return found;
  }
  return htonl(INADDR_LOOPBACK);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static bind_fn real_bind;
  if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  const char *mode = getenv("TFDIST_BIND");
  if (mode && strcmp(mode, "all") == 0) return real_bind(fd, addr, len);
  if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof a);
    if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
      a.sin_addr.s_addr = target();
      return real_bind(fd, (struct sockaddr *)&a, sizeof a);
    }
  } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof a);
    int v6only = 0;
    socklen_t optlen = sizeof v6only;
    if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) &&
        getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &optlen) == 0 && v6only) {
      /* An IPv6-only socket (Open MPI's second listener) cannot take an IPv4 address: it gets
       * the IPv6 loopback, reachable from this host only. */
      a.sin6_addr = in6addr_loopback;
      return real_bind(fd, (struct sockaddr *)&a, sizeof a);
    }
    if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
      in_addr_t v4 = target();
      unsigned char mapped[16] = {0,0,0,0,0,0,0,0,0,0,0xff,0xff};
      memcpy(mapped + 12, &v4, 4);
      memcpy(&a.sin6_addr, mapped, 16);
      return real_bind(fd, (struct sockaddr *)&a, sizeof a);
    }
  }
  return real_bind(fd, addr, len);
}
