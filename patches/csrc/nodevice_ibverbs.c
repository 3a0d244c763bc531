/* libibverbs.so.1 without an RDMA device (see nodevice.h): the device list is empty, every other
 * call fails with ENODEV (pointer functions: NULL and errno; int functions: the errno value, as
 * rdma-core's verbs return it). */
#include <stdlib.h>

#include "nodevice.h"

NODEVICE_EXPORT void **ibv_get_device_list(int *num_devices) {
  if (num_devices) *num_devices = 0;
  return calloc(1, sizeof(void *)); /* NULL-terminated and empty: no device */
}

NODEVICE_EXPORT void ibv_free_device_list(void **list) { free(list); }

NODEVICE_EXPORT const char *ibv_get_device_name() { return "none"; }
NODEVICE_EXPORT const char *ibv_wc_status_str() { return "no RDMA device"; }
NODEVICE_EXPORT const char *ibv_event_type_str() { return "no RDMA device"; }

NODEVICE_INT(ibv_fork_init, ENODEV)
NODEVICE_PTR(ibv_open_device)
NODEVICE_INT(ibv_close_device, ENODEV)
NODEVICE_INT(ibv_query_device, ENODEV)
NODEVICE_INT(ibv_query_port, ENODEV)
NODEVICE_INT(ibv_query_gid, ENODEV)
NODEVICE_INT(_ibv_query_gid_ex, ENODEV)
NODEVICE_PTR(ibv_alloc_pd)
NODEVICE_INT(ibv_dealloc_pd, ENODEV)
NODEVICE_PTR(ibv_reg_mr)
NODEVICE_PTR(ibv_reg_mr_iova2)
NODEVICE_PTR(ibv_reg_dmabuf_mr)
NODEVICE_INT(ibv_dereg_mr, ENODEV)
NODEVICE_PTR(ibv_create_comp_channel)
NODEVICE_INT(ibv_destroy_comp_channel, ENODEV)
NODEVICE_PTR(ibv_create_cq)
NODEVICE_INT(ibv_destroy_cq, ENODEV)
NODEVICE_INT(ibv_get_cq_event, ENODEV)
NODEVICE_VOID(ibv_ack_cq_events)
NODEVICE_PTR(ibv_create_qp)
NODEVICE_INT(ibv_modify_qp, ENODEV)
NODEVICE_INT(ibv_query_qp, ENODEV)
NODEVICE_INT(ibv_destroy_qp, ENODEV)
NODEVICE_PTR(ibv_create_ah)
NODEVICE_INT(ibv_destroy_ah, ENODEV)
NODEVICE_INT(ibv_get_async_event, ENODEV)
NODEVICE_VOID(ibv_ack_async_event)
