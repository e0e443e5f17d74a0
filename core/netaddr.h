/* netaddr.h - internal: where a worker finds the group and which address it listens on.
 *
 * - Slurm node lists ("h[1-3]", "gpu[01-04,07]", "a1,b[2-3]") expanded to host names, and the
 *   first host (MASTER_ADDR under srun when it is not set).
 * - MASTER_PORT derived from SLURM_JOB_ID, so two jobs sharing a node pick different ports.
 * - The listen address: TD_SOCKET_IFNAME (NCCL's syntax), else the source address of the route
 *   toward MASTER_ADDR, else loopback.
 *
 * core/netaddr.c depends only on libc and the rest of the bottom of core/ (status.c, core.c), so
 * tools/tdistrun compiles those in without the library.
 *
 * THREAD SAFETY: every function may run on any thread; none keeps state between calls.
 */
#ifndef TD_CORE_NETADDR_H
#define TD_CORE_NETADDR_H

#include <stdbool.h>
#include <stddef.h>

#include "tdist/status.h"

/* Largest number of hosts td__slurm_expand produces; larger lists are TD_ERR_INVALID (Slurm's
 * own limit on nodes per job is lower). */
#define TD__SLURM_MAX_HOSTS 65536
/* Longest host name produced, including its NUL. */
#define TD__SLURM_MAX_NAME 256

/* td__slurm_expand expands a Slurm node list into host names, in list order, duplicates kept.
 * Grammar: a comma-separated list of items (commas inside brackets do not split items); an item
 * is text with zero or more bracket groups, each a comma list of numbers or ranges "lo-hi"
 * (lo <= hi). A range keeps the zero padding of its lower bound ("01-10" -> 01..10); several
 * groups give the cartesian product ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2), as Slurm does.
 * Surrounding spaces in items are not allowed. Errors (TD_ERR_INVALID, with the list and the
 * position in td_last_error): NULL or empty list, an empty item, unbalanced or nested brackets,
 * an empty or non-numeric range, a reversed range, more than TD__SLURM_MAX_HOSTS hosts, a name
 * longer than TD__SLURM_MAX_NAME - 1; TD_ERR_NOMEM. On TD_OK, *hosts is a new array of *n
 * (>= 1) new strings: release with td__slurm_hosts_free(). On failure *hosts and *n are
 * untouched. */
td_status td__slurm_expand(const char *list, char ***hosts, size_t *n);

/* td__slurm_hosts_free frees what td__slurm_expand returned. NULL does nothing. */
void td__slurm_hosts_free(char **hosts, size_t n);

/* td__slurm_first_host writes the first host of a Slurm node list into out (n bytes), without
 * expanding the whole list. Errors as for td__slurm_expand (the whole list is still checked),
 * plus TD_ERR_INVALID when the name does not fit in n bytes; out is untouched on failure. */
td_status td__slurm_first_host(const char *list, char *out, size_t n);

/* Ports derived from a job id lie in [TD__SLURM_PORT_BASE, TD__SLURM_PORT_BASE +
 * TD__SLURM_PORT_SPAN): 20000..31999, below Linux's ephemeral range (32768-60999) so that an
 * outgoing connection never holds the port, and above most well-known services. */
#define TD__SLURM_PORT_BASE 20000
#define TD__SLURM_PORT_SPAN 12000

/* td__slurm_port derives a rendezvous port from SLURM_JOB_ID's value: TD__SLURM_PORT_BASE +
 * job_id % TD__SLURM_PORT_SPAN. Jobs whose ids differ by less than the span get different
 * ports. Job array tasks have their own job ids. Two steps of one job running at the same time
 * on one node get the same port: set MASTER_PORT for them. TD_ERR_INVALID when job_id is NULL or
 * not a decimal number (leading/trailing garbage included); *port untouched then. */
td_status td__slurm_port(const char *job_id, int *port);

/* td__job_port derives a rendezvous port in the same range from any job key (Open MPI's job:
 * PMIX_NAMESPACE or OMPI_MCA_ess_base_jobid): TD__SLURM_PORT_BASE + FNV-1a(key) %
 * TD__SLURM_PORT_SPAN, so two mpirun jobs on one host rarely share a port (1 in 12000; the run id
 * check refuses the second one then). */
int td__job_port(const char *job_key);

/* td__ifname_match says whether interface name ifname is selected by spec, NCCL_SOCKET_IFNAME's
 * syntax: a comma list of name prefixes ("eth,ib"); a leading '^' turns the list into
 * exclusions ("^docker,lo": any name starting with neither); a leading '=' (after '^' when both)
 * asks for exact names ("=eth0", "^=docker0"). Empty elements are ignored; a spec without any
 * element selects nothing ("" or "^" alone: nothing is selected, so callers reject them first
 * with td__ifname_spec_valid). Pure function: no system calls. */
bool td__ifname_match(const char *spec, const char *ifname);

/* td__ifname_spec_valid says whether spec has at least one non-empty element. */
bool td__ifname_spec_valid(const char *spec);

/* One address of one interface, as getifaddrs reports it (or a test makes up). */
typedef struct td__ifaddr {
  const char *name; /* interface name, "eth0" */
  int family;       /* AF_INET or AF_INET6 */
  const char *addr; /* numeric address without brackets: "10.0.0.2", "fd00::2" */
  bool up;          /* IFF_UP */
  bool loopback;    /* IFF_LOOPBACK */
  bool link_local;  /* IPv6 fe80::/10 (needs a scope id; never chosen) */
} td__ifaddr;

/* td__ifaddr_pick chooses the address to listen on among list[0..n) for spec (see
 * td__ifname_match): the first address of an interface that is up, selected by spec and not
 * IPv6 link-local, preferring family prefer (AF_INET, AF_INET6, or AF_UNSPEC for AF_INET first)
 * and, within a family, list order. Writes the address into out (n_out bytes) and, when ifname is
 * not NULL, the interface's name into ifname (ifname_n bytes). TD_ERR_INVALID for a spec without
 * elements or a result that does not fit; TD_ERR_NOT_FOUND (naming the spec and the interfaces
 * seen) when nothing matches. Pure function. Outputs untouched on failure. */
td_status td__ifaddr_pick(const char *spec, const td__ifaddr *list, size_t n, int prefer,
                          char *out, size_t n_out, char *ifname, size_t ifname_n);

/* td__choose_address chooses the address this worker listens on and advertises, writing it
 * (numeric, without brackets) into out (n bytes):
 *   1. ifname_spec non-NULL and non-empty (TD_SOCKET_IFNAME): td__ifaddr_pick over this host's
 *      interfaces, preferring MASTER_ADDR's family; no match is an error (TD_ERR_NOT_FOUND).
 *   2. master_addr loopback (127.0.0.0/8, ::1, "localhost"), NULL or empty: loopback of its
 *      family ("127.0.0.1" or "::1"), so single-host runs stay on loopback.
 *   3. otherwise the source address of the route toward master_addr, found by connecting a UDP
 *      socket (no packet is sent) and reading its local address; master_addr may be a name.
 *   4. when master_addr does not resolve or has no route: "127.0.0.1", with a warning.
 * The choice and its reason are logged at INFO ("listen address 10.0.0.2 (eth0): route toward
 * MASTER_ADDR 10.0.0.1"). Errors: TD_ERR_INVALID (NULL out, result does not fit, bad spec),
 * TD_ERR_NOT_FOUND, TD_ERR_IO (getifaddrs failed). out untouched on failure. Blocks for name
 * resolution when master_addr is a name. */
td_status td__choose_address(const char *master_addr, const char *ifname_spec, char *out,
                             size_t n);

/* td__addr_host copies the host of "host:port" or "[v6]:port" into out (truncated to n - 1). */
void td__addr_host(const char *addr, char *out, size_t n);

/* td__boot_id writes this machine's boot id (/proc/sys/kernel/random/boot_id; "-" when it cannot
 * be read): with the host address it tells processes on one machine apart from look-alikes
 * (containers sharing an address, a machine rebooted since) for same-host shortcuts (RPC direct
 * copy, shared-memory collectives). */
void td__boot_id(char *out, size_t n);

#endif
