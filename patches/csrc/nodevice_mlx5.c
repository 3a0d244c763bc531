/* libmlx5.so.1 (mlx5 direct verbs) without an RDMA device (see nodevice.h): every call fails with
 * ENODEV (object constructors: NULL and errno). */
#include "nodevice.h"

NODEVICE_INT(mlx5dv_init_obj, ENODEV)
NODEVICE_INT(mlx5dv_devx_general_cmd, ENODEV)
NODEVICE_INT(mlx5dv_devx_query_eqn, ENODEV)
NODEVICE_PTR(mlx5dv_devx_obj_create)
NODEVICE_INT(mlx5dv_devx_obj_modify, ENODEV)
NODEVICE_INT(mlx5dv_devx_obj_destroy, ENODEV)
NODEVICE_PTR(mlx5dv_devx_alloc_uar)
NODEVICE_VOID(mlx5dv_devx_free_uar)
NODEVICE_PTR(mlx5dv_devx_umem_reg)
NODEVICE_INT(mlx5dv_devx_umem_dereg, ENODEV)
