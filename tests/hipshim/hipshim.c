/*
 * libamdhip64.so over NVIDIA's driver API: lets hip-python's own bindings
 * drive peerd's HIP backend on an NVIDIA GPU.
 *
 * What it proves: the backend's HIP calls, their arguments, the struct
 * layouts it passes (64-byte IPC handles by pointer and by value, 16-byte
 * UUIDs, text buffers) and its error handling, all through the real
 * hip-python bindings on real device memory. What it cannot prove: how an
 * AMD driver behaves (uncached and fine-grained memory, XGMI peer access,
 * ROCm versions). Each HIP function below is the one-to-one driver-API call
 * HIP's own NVIDIA platform headers map it to.
 *
 * libcuda.so.1 is opened on first use, so the library loads (and every call
 * answers hipErrorNoDevice) on a machine without a driver: CI exercises the
 * bindings' error paths that way. Every allocation's flags are appended to
 * $HIPSHIM_LOG, so tests can check what the backend asked for.
 *
 * Build: gcc -shared -fPIC -O2 -o libamdhip64.so hipshim.c -ldl
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int hipError_t;
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } hipIpcMemHandle_t; /* HIP_IPC_HANDLE_SIZE, as CUipcMemHandle */
typedef struct { char bytes[16]; } hipUUID;

enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorNotInitialized = 3,
    hipErrorInsufficientDriver = 35,
    hipErrorNoDevice = 100,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidContext = 201,
    hipErrorMapFailed = 205,
    hipErrorAlreadyMapped = 208,
    hipErrorInvalidHandle = 400,
    hipErrorNotReady = 600,
    hipErrorPeerAccessAlreadyEnabled = 704,
    hipErrorHostMemoryAlreadyRegistered = 712,
    hipErrorHostMemoryNotRegistered = 713,
    hipErrorNotSupported = 801,
    hipErrorUnknown = 999,
};

static const struct { int code; const char *name; const char *text; } ERRORS[] = {
    {hipSuccess, "hipSuccess", "no error"},
    {hipErrorInvalidValue, "hipErrorInvalidValue", "invalid argument"},
    {hipErrorOutOfMemory, "hipErrorOutOfMemory", "out of memory"},
    {hipErrorNotInitialized, "hipErrorNotInitialized", "initialization error"},
    {hipErrorInsufficientDriver, "hipErrorInsufficientDriver", "driver version is insufficient"},
    {hipErrorNoDevice, "hipErrorNoDevice", "no device found"},
    {hipErrorInvalidDevice, "hipErrorInvalidDevice", "invalid device ordinal"},
    {hipErrorInvalidContext, "hipErrorInvalidContext", "invalid device context"},
    {hipErrorMapFailed, "hipErrorMapFailed", "mapping of buffer object failed"},
    {hipErrorAlreadyMapped, "hipErrorAlreadyMapped", "resource already mapped"},
    {hipErrorInvalidHandle, "hipErrorInvalidHandle", "invalid resource handle"},
    {hipErrorNotReady, "hipErrorNotReady", "device not ready"},
    {hipErrorPeerAccessAlreadyEnabled, "hipErrorPeerAccessAlreadyEnabled", "peer access is already enabled"},
    {hipErrorHostMemoryAlreadyRegistered, "hipErrorHostMemoryAlreadyRegistered", "part or all of the requested memory range is already mapped"},
    {hipErrorHostMemoryNotRegistered, "hipErrorHostMemoryNotRegistered", "pointer does not correspond to a registered memory region"},
    {hipErrorNotSupported, "hipErrorNotSupported", "operation not supported"},
    {hipErrorUnknown, "hipErrorUnknown", "unknown error"},
};
#define N_ERRORS (sizeof ERRORS / sizeof ERRORS[0])

/* The driver API, resolved by name from libcuda.so.1 on first use. */
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*DeviceGetUuid)(hipUUID *, CUdevice);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);
    CUresult (*DeviceTotalMem)(size_t *, CUdevice);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemsetD8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*IpcGetMemHandle)(hipIpcMemHandle_t *, CUdeviceptr);
    CUresult (*IpcOpenMemHandle)(CUdeviceptr *, hipIpcMemHandle_t, unsigned);
    CUresult (*IpcCloseMemHandle)(CUdeviceptr);
    CUresult (*MemHostRegister)(void *, size_t, unsigned);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
    CUresult (*DriverGetVersion)(int *);
} cu;

static pthread_once_t loaded = PTHREAD_ONCE_INIT;
static hipError_t load_error = hipSuccess;
static __thread hipError_t last_error = hipSuccess;

static void load(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) { load_error = hipErrorNoDevice; return; }
#define SYM(field, name) if (!(*(void **)&cu.field = dlsym(lib, name))) { load_error = hipErrorInsufficientDriver; return; }
    SYM(Init, "cuInit") SYM(DeviceGetCount, "cuDeviceGetCount") SYM(DeviceGet, "cuDeviceGet")
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") SYM(CtxSetCurrent, "cuCtxSetCurrent")
    SYM(CtxGetCurrent, "cuCtxGetCurrent") SYM(CtxGetDevice, "cuCtxGetDevice") SYM(CtxSynchronize, "cuCtxSynchronize")
    SYM(DeviceGetUuid, "cuDeviceGetUuid") SYM(DeviceGetName, "cuDeviceGetName")
    SYM(DeviceGetPCIBusId, "cuDeviceGetPCIBusId") SYM(DeviceTotalMem, "cuDeviceTotalMem_v2")
    SYM(MemGetInfo, "cuMemGetInfo_v2") SYM(MemAlloc, "cuMemAlloc_v2") SYM(MemFree, "cuMemFree_v2")
    SYM(MemsetD8, "cuMemsetD8_v2") SYM(IpcGetMemHandle, "cuIpcGetMemHandle")
    SYM(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2") SYM(IpcCloseMemHandle, "cuIpcCloseMemHandle")
    SYM(MemHostRegister, "cuMemHostRegister_v2") SYM(MemHostUnregister, "cuMemHostUnregister")
    SYM(MemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2") SYM(DriverGetVersion, "cuDriverGetVersion")
#undef SYM
    if (cu.Init(0) != 0) load_error = hipErrorNoDevice;
}

/* HIP numbers its errors as CUDA does; anything this shim does not know is hipErrorUnknown. */
static hipError_t done(CUresult r) {
    hipError_t e = hipErrorUnknown;
    for (size_t i = 0; i < N_ERRORS; i++)
        if (ERRORS[i].code == r) e = r;
    if (e != hipSuccess) last_error = e;
    return e;
}

#define READY() do { pthread_once(&loaded, load); if (load_error) return done(load_error); } while (0)

/* HIP's implicit device 0: a thread with no current context gets device 0's primary one. */
static hipError_t with_context(void) {
    CUcontext ctx = NULL;
    CUresult r = cu.CtxGetCurrent(&ctx);
    if (r == 0 && ctx) return hipSuccess;
    CUdevice dev;
    if ((r = cu.DeviceGet(&dev, 0)) || (r = cu.DevicePrimaryCtxRetain(&ctx, dev))) return done(r);
    return done(cu.CtxSetCurrent(ctx));
}
#define CONTEXT() do { READY(); hipError_t e_ = with_context(); if (e_) return e_; } while (0)

static void record(const char *what, size_t size, unsigned flags, CUdeviceptr ptr) {
    const char *path = getenv("HIPSHIM_LOG");
    if (!path) return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    char line[160];
    int n = snprintf(line, sizeof line, "pid=%d %s size=%zu flags=0x%x ptr=0x%llx\n", getpid(), what, size, flags, ptr);
    if (n > 0) (void)!write(fd, line, (size_t)n);
    close(fd);
}

const char *hipGetErrorName(hipError_t e) {
    for (size_t i = 0; i < N_ERRORS; i++) if (ERRORS[i].code == e) return ERRORS[i].name;
    return "hipErrorUnknown";
}
const char *hipGetErrorString(hipError_t e) {
    for (size_t i = 0; i < N_ERRORS; i++) if (ERRORS[i].code == e) return ERRORS[i].text;
    return "unknown error";
}
hipError_t hipGetLastError(void) { hipError_t e = last_error; last_error = hipSuccess; return e; }
hipError_t hipPeekAtLastError(void) { return last_error; }

hipError_t hipDriverGetVersion(int *v) { READY(); return done(cu.DriverGetVersion(v)); }
hipError_t hipRuntimeGetVersion(int *v) { READY(); return done(cu.DriverGetVersion(v)); }
hipError_t hipGetDeviceCount(int *n) { READY(); return done(cu.DeviceGetCount(n)); }

hipError_t hipSetDevice(int ordinal) {
    READY();
    CUdevice dev; CUcontext ctx; CUresult r;
    if ((r = cu.DeviceGet(&dev, ordinal)) || (r = cu.DevicePrimaryCtxRetain(&ctx, dev))) return done(r);
    return done(cu.CtxSetCurrent(ctx));
}
hipError_t hipGetDevice(int *ordinal) { CONTEXT(); return done(cu.CtxGetDevice(ordinal)); }
hipError_t hipDeviceSynchronize(void) { CONTEXT(); return done(cu.CtxSynchronize()); }

static hipError_t device(int ordinal, CUdevice *dev) { READY(); return done(cu.DeviceGet(dev, ordinal)); }
hipError_t hipDeviceGetUuid(hipUUID *uuid, int ordinal) {
    CUdevice d; hipError_t e = device(ordinal, &d); return e ? e : done(cu.DeviceGetUuid(uuid, d));
}
hipError_t hipDeviceGetName(char *name, int len, int ordinal) {
    CUdevice d; hipError_t e = device(ordinal, &d); return e ? e : done(cu.DeviceGetName(name, len, d));
}
hipError_t hipDeviceGetPCIBusId(char *bus, int len, int ordinal) {
    CUdevice d; hipError_t e = device(ordinal, &d); return e ? e : done(cu.DeviceGetPCIBusId(bus, len, d));
}
hipError_t hipDeviceTotalMem(size_t *bytes, int ordinal) {
    CUdevice d; hipError_t e = device(ordinal, &d); return e ? e : done(cu.DeviceTotalMem(bytes, d));
}
hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total) { CONTEXT(); return done(cu.MemGetInfo(free_bytes, total)); }

static hipError_t allocate(const char *what, void **ptr, size_t size, unsigned flags) {
    CONTEXT();
    CUdeviceptr p = 0;
    hipError_t e = done(cu.MemAlloc(&p, size));
    *ptr = (void *)p;
    record(what, size, flags, p);
    return e;
}
hipError_t hipExtMallocWithFlags(void **ptr, size_t size, unsigned flags) { return allocate("hipExtMallocWithFlags", ptr, size, flags); }
hipError_t hipMalloc(void **ptr, size_t size) { return allocate("hipMalloc", ptr, size, 0); }
hipError_t hipFree(void *ptr) { CONTEXT(); record("hipFree", 0, 0, (CUdeviceptr)ptr); return done(cu.MemFree((CUdeviceptr)ptr)); }
hipError_t hipMemset(void *dst, int value, size_t size) { CONTEXT(); return done(cu.MemsetD8((CUdeviceptr)dst, (unsigned char)value, size)); }

hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *handle, void *ptr) { CONTEXT(); return done(cu.IpcGetMemHandle(handle, (CUdeviceptr)ptr)); }
hipError_t hipIpcOpenMemHandle(void **ptr, hipIpcMemHandle_t handle, unsigned flags) {
    CONTEXT();
    CUdeviceptr p = 0;
    hipError_t e = done(cu.IpcOpenMemHandle(&p, handle, flags)); /* hipIpcMemLazyEnablePeerAccess == CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    *ptr = (void *)p;
    return e;
}
hipError_t hipIpcCloseMemHandle(void *ptr) { CONTEXT(); return done(cu.IpcCloseMemHandle((CUdeviceptr)ptr)); }

/* hipHostRegisterPortable (1) and hipHostRegisterMapped (2) have CUDA's values. */
hipError_t hipHostRegister(void *host, size_t size, unsigned flags) {
    CONTEXT(); record("hipHostRegister", size, flags, (CUdeviceptr)host); return done(cu.MemHostRegister(host, size, flags));
}
hipError_t hipHostUnregister(void *host) { CONTEXT(); record("hipHostUnregister", 0, 0, (CUdeviceptr)host); return done(cu.MemHostUnregister(host)); }
hipError_t hipHostGetDevicePointer(void **dev, void *host, unsigned flags) {
    CONTEXT();
    CUdeviceptr p = 0;
    hipError_t e = done(cu.MemHostGetDevicePointer(&p, host, flags));
    *dev = (void *)p;
    return e;
}
