/* ps_ft.h - fault tolerance for the parameter-server example (not part of the library):
 * checkpoints of the model together with the training progress, resuming from them, and a
 * watchdog that pings the trainers and stops the group when one is lost.
 *
 * Checkpoints (--checkpoint-dir DIR, --checkpoint-every N): a step is one batch of every trainer;
 * the global step before batch b of epoch e is e * batches_per_epoch + b. Every N global steps the
 * trainers meet at a barrier (registered function "ps_ckpt") and the server writes
 * DIR/param_server.safetensors: the model's state dict, with the progress record (model kind,
 * epoch, step, batches per epoch, trainers) in the file's metadata, so model and progress change
 * together in one atomic write (a temporary file renamed into place). At start (a fresh run or a
 * launcher's restart, TD_RESTART_COUNT > 0) the server loads that file when it exists, and the
 * trainers ("ps_resume") continue from the recorded epoch and step. The optimizer's momentum is
 * not saved: a resumed run restarts it from zero.
 *
 * Failures: the examples' watchdog (watchdog.h), on by default, pings: the server every
 * trainer, each trainer the server, every --keepalive-ms (TD_KEEPALIVE_MS, default 2000); a
 * worker that died fails its ping at once, one that hangs within --keepalive-timeout-ms
 * (TD_KEEPALIVE_TIMEOUT_MS, default 20000; the agent uses both settings too). On the server the
 * example's on_fail callback then fails the calls the trainers wait on with a message naming the
 * lost worker, and the server exits with status 1, so a launcher can restart the group; a
 * trainer that loses the server prints the line and exits 1. TD_WATCHDOG=0 turns it off.
 * THREAD SAFETY: the psft_server_* and psft_watchdog_* calls from the server's main thread, the
 * psft_trainer_* calls from a trainer's main thread; psft_check_alive from any thread.
 * Lock order: the module's state (ft.mu) is a leaf; on_fail runs with no lock of this file held.
 */
#ifndef TD_PS_FT_H
#define TD_PS_FT_H

#include <stdbool.h>
#include <stdint.h>

#include "example_util.h"
#include "tdist/data.h"
#include "tdist/nn.h"
#include "tdist/rpc.h"

/* ---- options ---- */

typedef struct psft_options {
  const char *ckpt_dir;   /* NULL: no checkpoints */
  int64_t ckpt_every;     /* global steps between checkpoints; 0 with a dir: 100 */
  int64_t keepalive_ms;   /* 0: the default, 2000 */
  int64_t keepalive_timeout_ms;
} psft_options;

#define PSFT_NOPTS 4
/* psft_options_init fills *o with the defaults (the keepalive ones from the environment) and
 * opts[0..PSFT_NOPTS) with the command-line options for ex_args_parse. */
void psft_options_init(psft_options *o, ex_opt opts[PSFT_NOPTS]);
/* psft_options_apply checks the parsed options (dies with a message on a bad one) and sets the
 * agent's keepalive settings in *ro. */
void psft_options_apply(psft_options *o, td_rpc_options *ro);
/* psft_register registers ps_resume, ps_ckpt and the watchdog's functions (every worker, before
 * td_rpc_init). */
void psft_register(void);

/* ---- the server (rank 0) ---- */

/* psft_server_init records the model and, with a checkpoint directory, loads the checkpoint into
 * model when one exists (dies when it does not fit this run: other model, trainers, or past
 * `epochs`). Call before the trainers can reach the model. */
void psft_server_init(const psft_options *o, td_module *model, const char *model_kind,
                      int trainers, int epochs);
/* psft_resume_epoch returns the epoch the run starts at (0 without a checkpoint). */
int64_t psft_resume_epoch(void);
/* psft_server_results adds resumed_from_epoch / _step / _global_step to the JSON results of a
 * resumed run. */
void psft_server_results(ex_json *results);
/* psft_watchdog_start starts the watchdog (every worker, after td_rpc_init; unless TD_WATCHDOG=0).
 * On the server on_fail runs once, with the failure message, when a trainer is lost, and the
 * server exits 1; trainers pass NULL (a lost server: the line and exit 1). */
void psft_watchdog_start(td_rpc_agent *a, const psft_options *o, void (*on_fail)(const char *msg));
/* psft_watchdog_stop ends the pings (before the trainers may leave). Safe to call twice. */
void psft_watchdog_stop(void);
/* psft_check_alive returns TD_OK, or TD_ERR_UNAVAILABLE (message set) once a trainer failed. */
td_status psft_check_alive(void);
/* psft_die_failed exits the server with status 1 after giving the live trainers a moment to
 * receive the error (a graceful RPC shutdown would wait for the lost trainer). */
_Noreturn void psft_die_failed(void);

/* ---- a trainer (ranks 1..N-1) ---- */

typedef struct psft_trainer {
  int64_t start_epoch, start_step; /* where the server's checkpoint left off (0, 0: beginning) */
  int64_t nb;                      /* batches per epoch of this run */
  int64_t every;                   /* global steps between checkpoints; 0: none */
} psft_trainer;

/* psft_trainer_resume asks the server where to start (dies when the checkpoint was made with
 * other batches per epoch). */
void psft_trainer_resume(td_rpc_agent *a, const psft_options *o, int tid, int64_t nb,
                         psft_trainer *t);
/* psft_trainer_first_batch returns the batch epoch starts at, drawing from s the batches the
 * checkpoint already holds. */
int64_t psft_trainer_first_batch(const psft_trainer *t, int epoch, td_sampler *s);
/* psft_trainer_before_batch meets the server's checkpoint barrier when one is due before batch b
 * of epoch. */
void psft_trainer_before_batch(td_rpc_agent *a, const psft_trainer *t, int epoch, int64_t b);

#endif
