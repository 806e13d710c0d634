// A stand-in libcuda.so.1 for tests/_fast_path_probe.py (no GPU): Triton 3.6's own driver.c and
// generated C launchers are compiled against it, and fusedqkv's ctypes launch calls it too.
// cuLaunchKernelEx records what the driver would read -- the launch config, its attributes and
// the bytes of each kernel parameter, sized as the kernel's PTX declares them (fake_expect_params)
// -- so the probe compares the two launches byte for byte. cuTensorMapEncodeTiled writes every
// argument it gets into the 128-byte map, so a map encoded for another address or shape differs.
#include "cuda.h"
#include <stdint.h>
#include <string.h>

static size_t param_sizes[512];
static int n_params = -1;  // -1: sizes unknown, parameters not recorded
static unsigned char record[1 << 16];
static size_t record_len = 0;
static long n_launches = 0;

void fake_expect_params(int n, const size_t *sizes) {
  n_params = n;
  for (int i = 0; i < n && i < 512; ++i) param_sizes[i] = sizes[i];
}

size_t fake_record(unsigned char *out, size_t cap) {
  memcpy(out, record, record_len < cap ? record_len : cap);
  return record_len;
}

long fake_launches(void) { return n_launches; }

static void put(const void *p, size_t n) {
  if (record_len + n <= sizeof(record)) memcpy(record + record_len, p, n);
  record_len += n;
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
  record_len = 0;
  ++n_launches;
  put(&config->gridDimX, 4);
  put(&config->gridDimY, 4);
  put(&config->gridDimZ, 4);
  put(&config->blockDimX, 4);
  put(&config->blockDimY, 4);
  put(&config->blockDimZ, 4);
  put(&config->sharedMemBytes, 4);
  uint64_t stream = (uint64_t)(uintptr_t)config->hStream, fn = (uint64_t)(uintptr_t)f;
  uint64_t ex = (uint64_t)(uintptr_t)extra;
  put(&stream, 8);
  put(&fn, 8);
  put(&ex, 8);
  put(&config->numAttrs, 4);
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    put(&config->attrs[i].id, 4);
    put(&config->attrs[i].value, 64);
  }
  int32_t n = n_params;
  put(&n, 4);
  for (int i = 0; i < n_params; ++i) put(kernelParams[i], param_sizes[i]);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType dt, cuuint32_t rank, void *addr,
                                        const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                        const cuuint32_t *elem_strides, CUtensorMapInterleave il,
                                        CUtensorMapSwizzle sw, CUtensorMapL2promotion l2,
                                        CUtensorMapFloatOOBfill oob) {
  unsigned char *m = (unsigned char *)map;
  memset(m, 0, 128);
  uint64_t a = (uint64_t)(uintptr_t)addr;
  memcpy(m, &a, 8);
  m[8] = (unsigned char)dt, m[9] = (unsigned char)rank, m[10] = (unsigned char)il, m[11] = (unsigned char)sw;
  m[12] = (unsigned char)l2, m[13] = (unsigned char)oob, m[14] = 0xA5, m[15] = 0x5A;
  if (rank > 5) return CUDA_ERROR_INVALID_VALUE;
  memcpy(m + 16, dims, 8 * rank);
  if (rank > 1) memcpy(m + 56, strides, 8 * (rank - 1));
  memcpy(m + 88, box, 4 * rank);
  memcpy(m + 108, elem_strides, 4 * rank);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  *(CUdeviceptr *)data = ptr;  // every address is a device address
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **str) {
  *str = "fake error";
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **str) {
  *str = error == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
  *pctx = (CUcontext)(uintptr_t)0xC7C7;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetLimit(size_t *value, CUlimit limit) {
  *value = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
  *device = ordinal;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  *pi = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  *pctx = (CUcontext)(uintptr_t)0xC7C7;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
  *pi = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) { return CUDA_ERROR_INVALID_VALUE; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config) {
  *numClusters = 0;
  return CUDA_SUCCESS;
}
