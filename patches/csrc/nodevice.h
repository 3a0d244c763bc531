/* Shared by the no-device libraries (nodevice_*.c): the PD transfer engine on a machine without a
 * GPU or an RDMA NIC. mooncake-transfer-engine's wheel links libcudart.so.12, libcuda.so.1,
 * libibverbs.so.1 and libmlx5.so.1; with MC_FORCE_TCP=1 it moves KV over TCP and needs none of
 * them, but the dynamic linker must find each before the engine imports. Each library here carries
 * the real one's SONAME, defines exactly the functions the wheel calls, and answers every call as
 * the real library does on a machine without the device: no device, nothing allocated.
 * kvguard.patches.pd_cpu loads one only when the real library cannot be loaded, and only on the
 * PD path (never for a single server).
 *
 * The functions are declared without a prototype (C11 `()`): callers pass the real library's
 * arguments, which these ignore; on x86-64 and aarch64 the caller owns its arguments, so the call
 * is sound. Each returns the type the real function returns: an int status, a pointer or nothing. */
#ifndef KVGUARD_NODEVICE_H
#define KVGUARD_NODEVICE_H

#include <errno.h>
#include <stddef.h>

#define NODEVICE_EXPORT __attribute__((visibility("default")))

/* an int-returning function: the status the real library returns without a device */
#define NODEVICE_INT(name, status) NODEVICE_EXPORT int name() { return (status); }

/* a pointer-returning function: NULL, errno ENODEV (rdma-core's convention for failures) */
#define NODEVICE_PTR(name)       \
  NODEVICE_EXPORT void *name() { \
    errno = ENODEV;              \
    return NULL;                 \
  }

/* a function that returns nothing (releases, acknowledgements): nothing to do */
#define NODEVICE_VOID(name) \
  NODEVICE_EXPORT void name() {}

#endif
