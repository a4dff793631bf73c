/* Arrays as the emulation programs take and give them (`harness.c`, `model_driver.c`): one argument
 * CODE:BITS:D0,D1,...:FILE per array (DLPack's type code and bits, its shape, a file of its bytes). */
#ifndef TVMATTN_CROSS_ARRAYS_H_
#define TVMATTN_CROSS_ARRAYS_H_

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tvm/ffi/c_api.h>

#define MAX_DIMS 8

/* 64-byte aligned, as TVM's workspace allocator gives it (kernels assume it of their arrays) */
static void* aligned_bytes(size_t nbytes) {
  void* ptr = NULL;
  return posix_memalign(&ptr, 64, nbytes ? nbytes : 1) == 0 ? ptr : NULL;
}

static size_t array_bytes(const DLTensor* t) {
  size_t count = 1;
  for (int i = 0; i < t->ndim; ++i) count *= (size_t)t->shape[i];
  return count * ((t->dtype.bits * t->dtype.lanes + 7) / 8);
}

/* ``spec`` (written into) as a CPU DLTensor over ``shape`` with its file in ``path``; its bytes, 0 if malformed */
static size_t parse_array(char* spec, DLTensor* t, int64_t* shape, char** path) {
  char* code = strtok(spec, ":");
  char* bits = strtok(NULL, ":");
  char* dims = strtok(NULL, ":");
  *path = strtok(NULL, "");
  if (code == NULL || bits == NULL || dims == NULL || *path == NULL) return 0;
  memset(t, 0, sizeof(*t));
  t->device.device_type = kDLCPU;
  t->dtype.code = (uint8_t)atoi(code);
  t->dtype.bits = (uint8_t)atoi(bits);
  t->dtype.lanes = 1;
  if (strcmp(dims, "-") != 0)  /* "-": a scalar */
    for (char* d = strtok(dims, ","); d != NULL && t->ndim < MAX_DIMS; d = strtok(NULL, ","))
      shape[t->ndim++] = atoll(d);
  t->shape = shape;
  return array_bytes(t);
}

/* the file's bytes into ``data`` (and ``data`` into the file): 0 on success */
static int read_array(const char* path, void* data, size_t nbytes) {
  FILE* f = fopen(path, "rb");
  int rc = f == NULL || fread(data, 1, nbytes, f) != nbytes;
  if (f != NULL) fclose(f);
  if (rc) fprintf(stderr, "cannot read %zu bytes from %s\n", nbytes, path);
  return rc;
}

static int write_array(const char* path, const void* data, size_t nbytes) {
  FILE* f = fopen(path, "wb");
  int rc = f == NULL || fwrite(data, 1, nbytes, f) != nbytes;
  if (f != NULL && fclose(f) != 0) rc = 1;
  if (rc) fprintf(stderr, "cannot write %zu bytes to %s\n", nbytes, path);
  return rc;
}

#endif  // TVMATTN_CROSS_ARRAYS_H_
