/* layers.h - registration entry points of the layers above the RPC agent (internal). */
#ifndef TD_RUNTIME_LAYERS_H
#define TD_RUNTIME_LAYERS_H

void td__rref_layer_init(void);          /* rref/rref.c */
void td__dist_autograd_layer_init(void); /* dist_autograd/context.c */
void td__dist_optim_layer_init(void);    /* dist_optim/dist_optim.c */
void td__remote_layer_init(void);        /* remote/remote_module.c */

#endif
