/* libcuda.so.1 (the driver API) without a GPU (see nodevice.h): every call returns
 * CUDA_ERROR_NO_DEVICE; the error-name lookups answer, as the real driver's do. */
#include "nodevice.h"

enum { CUDA_SUCCESS = 0, CUDA_ERROR_NO_DEVICE = 100 };

static const char *describe(int error) {
  return error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected"
                                       : "CUDA is unavailable (kvguard no-device libcuda)";
}

NODEVICE_EXPORT int cuGetErrorString(int error, const char **text) {
  if (text) *text = describe(error);
  return CUDA_SUCCESS;
}

NODEVICE_EXPORT int cuGetErrorName(int error, const char **name) {
  if (name) *name = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}

NODEVICE_EXPORT int cuDriverGetVersion(int *version) {
  if (version) *version = 0;
  return CUDA_ERROR_NO_DEVICE;
}

NODEVICE_INT(cuInit, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuGetProcAddress, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuGetProcAddress_v2, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuDeviceGet, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuDeviceGetAttribute, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuDevicePrimaryCtxRetain, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuDevicePrimaryCtxRelease_v2, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuCtxGetDevice, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuCtxSetCurrent, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuPointerGetAttribute, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuPointerSetAttribute, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemCreate, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemRelease, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemMap, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemUnmap, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemSetAccess, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemAddressReserve, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemAddressFree, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemGetAddressRange_v2, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemGetAllocationGranularity, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemGetHandleForAddressRange, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemExportToShareableHandle, CUDA_ERROR_NO_DEVICE)
NODEVICE_INT(cuMemImportFromShareableHandle, CUDA_ERROR_NO_DEVICE)
