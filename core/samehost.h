/* samehost.h - the one same-host probe of tdist, shared by the RPC layer's direct copy
 * (rpc/direct.c) and the collectives' shared memory (collectives/shm.c).
 *
 * Each process publishes a record (through the rendezvous store, whose sessions are
 * authenticated) naming its pid, a random nonce and the nonce's address in its memory, its boot
 * id, its pid namespace and the host part of its advertised address:
 *   "<pid> <nonce> <nonce address> <boot id> <pid namespace> <host>"
 * or "-" when it cannot or must not share (no boot id or namespace readable, or turned off).
 * Two processes are on one host when boot id, pid namespace and host agree (a pid means the same
 * process to both only inside one pid namespace; the host keeps apart containers that share a
 * kernel but advertise different addresses). A peer's memory is readable when
 * process_vm_readv(pid, nonce address) returns its nonce: same user, no ptrace restriction.
 * Before this file the two layers each wrote their own record, and the RPC one left the pid
 * namespace out.
 */
#ifndef TD_CORE_SAMEHOST_H
#define TD_CORE_SAMEHOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct td__host_rec {
  int pid;
  uint64_t nonce, addr;
  char boot[64], pidns[64], host[256];
} td__host_rec;

/* td__samehost_nonce returns a fresh random nonce (getrandom; clock and address mixed in when
 * that fails). */
uint64_t td__samehost_nonce(const void *salt);
/* td__samehost_record writes this process's record into buf: *nonce (which must stay at its
 * address while peers may probe) and host, the host part of its advertised address. Writes "-"
 * and returns false when no record can be made. */
bool td__samehost_record(const char *host, const uint64_t *nonce, char *buf, size_t n);
/* td__samehost_parse reads a record; false for "-" or anything malformed. */
bool td__samehost_parse(const char *rec, td__host_rec *out);
/* td__samehost_same: two parsed records name one host, boot and pid namespace. */
bool td__samehost_same(const td__host_rec *a, const td__host_rec *b);
/* td__samehost_readable reads the peer's nonce from its memory (process_vm_readv): true when the
 * read works and returns the nonce it published. */
bool td__samehost_readable(const td__host_rec *peer);

#endif
