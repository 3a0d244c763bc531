/* libcudart.so.12 without a GPU (see nodevice.h): every call returns cudaErrorNoDevice, the device
 * count is 0. */
#include "nodevice.h"

enum { cudaErrorNoDevice = 100 };

NODEVICE_EXPORT int cudaGetDeviceCount(int *count) {
  if (count) *count = 0;
  return cudaErrorNoDevice;
}

NODEVICE_EXPORT const char *cudaGetErrorString(int error) {
  return error == cudaErrorNoDevice ? "no CUDA-capable device is detected"
                                    : "CUDA is unavailable (kvguard no-device libcudart)";
}

NODEVICE_INT(cudaGetLastError, cudaErrorNoDevice)
NODEVICE_INT(cudaGetDevice, cudaErrorNoDevice)
NODEVICE_INT(cudaSetDevice, cudaErrorNoDevice)
NODEVICE_INT(cudaGetDeviceProperties_v2, cudaErrorNoDevice)
NODEVICE_INT(cudaDeviceGetPCIBusId, cudaErrorNoDevice)
NODEVICE_INT(cudaDeviceCanAccessPeer, cudaErrorNoDevice)
NODEVICE_INT(cudaDeviceEnablePeerAccess, cudaErrorNoDevice)
NODEVICE_INT(cudaPointerGetAttributes, cudaErrorNoDevice)
NODEVICE_INT(cudaMalloc, cudaErrorNoDevice)
NODEVICE_INT(cudaFree, cudaErrorNoDevice)
NODEVICE_INT(cudaHostAlloc, cudaErrorNoDevice)
NODEVICE_INT(cudaFreeHost, cudaErrorNoDevice)
NODEVICE_INT(cudaHostRegister, cudaErrorNoDevice)
NODEVICE_INT(cudaHostUnregister, cudaErrorNoDevice)
NODEVICE_INT(cudaHostGetDevicePointer, cudaErrorNoDevice)
NODEVICE_INT(cudaMemcpy, cudaErrorNoDevice)
NODEVICE_INT(cudaMemcpyBatchAsync, cudaErrorNoDevice)
NODEVICE_INT(cudaMemset, cudaErrorNoDevice)
NODEVICE_INT(cudaMemsetAsync, cudaErrorNoDevice)
NODEVICE_INT(cudaIpcGetMemHandle, cudaErrorNoDevice)
NODEVICE_INT(cudaIpcOpenMemHandle, cudaErrorNoDevice)
NODEVICE_INT(cudaIpcCloseMemHandle, cudaErrorNoDevice)
NODEVICE_INT(cudaStreamCreateWithFlags, cudaErrorNoDevice)
NODEVICE_INT(cudaStreamDestroy, cudaErrorNoDevice)
NODEVICE_INT(cudaStreamQuery, cudaErrorNoDevice)
NODEVICE_INT(cudaStreamSynchronize, cudaErrorNoDevice)
NODEVICE_INT(cudaLaunchHostFunc, cudaErrorNoDevice)
NODEVICE_INT(cudaEventCreateWithFlags, cudaErrorNoDevice)
NODEVICE_INT(cudaEventDestroy, cudaErrorNoDevice)
NODEVICE_INT(cudaEventRecord, cudaErrorNoDevice)
NODEVICE_INT(cudaEventSynchronize, cudaErrorNoDevice)
