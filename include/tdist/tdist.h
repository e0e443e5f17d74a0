/* tdist.h - umbrella header: includes every public tdist header. */
#ifndef TDIST_TDIST_H
#define TDIST_TDIST_H

#include "tdist/version.h"
#include "tdist/status.h"
#include "tdist/timeout.h"
#include "tdist/tensor.h"
#include "tdist/trace.h"
#include "tdist/autograd.h"
#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/data.h"
#include "tdist/value.h"
#include "tdist/future.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/remote_module.h"
#include "tdist/pipeline.h"
#include "tdist/collectives.h"
#include "tdist/parallel.h"

#endif /* TDIST_TDIST_H */
