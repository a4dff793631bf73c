/* Runs a whole model (a Relax VM executable exported as a shared library for this CPU) on TVM's own
 * runtime, inputs read from files and outputs written to files: how a model compiled for another CPU
 * is checked under qemu-user (`tvmattn.compiler.cross.emulate.run_model`).
 *
 *   model_driver LIBRARY OUT_DIR CODE:BITS:D0,D1,...:FILE ...      the model's inputs in order
 *
 * Output i goes to OUT_DIR/out<i>.bin, described on stdout as "i CODE:BITS:D0,D1,...". Everything is
 * reached through TVM-FFI's C calling convention and the runtime's global functions, as Python does. */
#include "arrays.h"

#define MAX_ARGS 64

static void fail(const char* what) {
  TVMFFIObjectHandle err = NULL;
  TVMFFIErrorMoveFromRaised(&err);
  if (err != NULL) {
    const TVMFFIErrorCell* cell = (const TVMFFIErrorCell*)((const char*)err + sizeof(TVMFFIObject));
    fprintf(stderr, "%s: %.*s: %.*s\n", what, (int)cell->kind.size, cell->kind.data, (int)cell->message.size,
            cell->message.data);
  } else {
    fprintf(stderr, "%s failed\n", what);
  }
  exit(1);
}

static TVMFFIAny none(void) {
  TVMFFIAny any;
  memset(&any, 0, sizeof(any));
  any.type_index = kTVMFFINone;
  return any;
}

static TVMFFIAny object(int32_t type_index, void* obj) {
  TVMFFIAny any = none();
  any.type_index = type_index;
  any.v_obj = (TVMFFIObject*)obj;
  return any;
}

static TVMFFIAny integer(int32_t type_index, int64_t value) {
  TVMFFIAny any = none();
  any.type_index = type_index;
  any.v_int64 = value;
  return any;
}

static TVMFFIAny text(const char* str) {
  TVMFFIAny any = none();
  any.type_index = kTVMFFIRawStr;
  any.v_c_str = str;
  return any;
}

static TVMFFIAny call(void* func, TVMFFIAny* args, int num_args, const char* what) {
  TVMFFIAny result = none();
  if (TVMFFIFunctionCall(func, args, num_args, &result) != 0) fail(what);
  return result;
}

static void* global(const char* name) {
  TVMFFIByteArray bytes = {name, strlen(name)};
  void* func = NULL;
  if (TVMFFIFunctionGetGlobal(&bytes, &func) != 0 || func == NULL) {
    fprintf(stderr, "TVM's runtime has no global function %s\n", name);
    exit(1);
  }
  return func;
}

/* the module's function ``name`` (Relax VM functions are functions of the VM's module) */
static void* function(TVMFFIAny module, const char* name) {
  TVMFFIAny args[3] = {module, text(name), integer(kTVMFFIBool, 1)};
  TVMFFIAny func = call(global("ffi.ModuleGetFunction"), args, 3, name);
  if (func.type_index != kTVMFFIFunction) {
    fprintf(stderr, "the library has no function %s\n", name);
    exit(1);
  }
  return func.v_obj;
}

static void free_managed(DLManagedTensor* self) { free(self); }

/* an input array as a TVM-FFI tensor (its data stays ours, alive until the program ends) */
static TVMFFIAny tensor(const DLTensor* t) {
  DLManagedTensor* managed = calloc(1, sizeof(DLManagedTensor));
  managed->dl_tensor = *t;
  managed->deleter = free_managed;
  void* handle = NULL;
  if (TVMFFITensorFromDLPack(managed, 0, 1, &handle) != 0) fail("an input tensor");
  return object(kTVMFFITensor, handle);
}

static int write_output(int i, TVMFFIAny out, const char* dir) {
  if (out.type_index != kTVMFFITensor) {
    fprintf(stderr, "output %d is not a tensor (type index %d)\n", i, out.type_index);
    return 1;
  }
  const DLTensor* t = (const DLTensor*)((const char*)out.v_obj + sizeof(TVMFFIObject));
  if (t->strides != NULL) {  /* compact strides are fine: outputs the VM allocates are */
    int64_t step = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      if (t->shape[d] != 1 && t->strides[d] != step) {
        fprintf(stderr, "output %d is not contiguous\n", i);
        return 1;
      }
      step *= t->shape[d];
    }
  }
  char path[4096];
  snprintf(path, sizeof(path), "%s/out%d.bin", dir, i);
  if (write_array(path, (const char*)t->data + t->byte_offset, array_bytes(t))) return 1;
  printf("%d %d:%d:", i, t->dtype.code, t->dtype.bits);
  for (int d = 0; d < t->ndim; ++d) printf(d ? ",%lld" : "%lld", (long long)t->shape[d]);
  printf(t->ndim ? "\n" : "-\n");
  return 0;
}

int main(int argc, char** argv) {
  static DLTensor arrays[MAX_ARGS];
  static int64_t shapes[MAX_ARGS][MAX_DIMS];
  static TVMFFIAny inputs[MAX_ARGS];
  int n = argc - 3;
  if (n < 0 || n > MAX_ARGS) {
    fprintf(stderr, "usage: %s LIBRARY OUT_DIR CODE:BITS:D0,D1,...:FILE ...\n", argv[0]);
    return 2;
  }
  for (int i = 0; i < n; ++i) {
    char* path = NULL;
    size_t bytes = parse_array(argv[i + 3], &arrays[i], shapes[i], &path);
    arrays[i].data = aligned_bytes(bytes);
    if (path == NULL || arrays[i].data == NULL || read_array(path, arrays[i].data, bytes)) {
      fprintf(stderr, "input %d: cannot read %s\n", i, argv[i + 3]);
      return 2;
    }
    inputs[i] = tensor(&arrays[i]);
  }
  TVMFFIAny path = text(argv[1]);
  TVMFFIAny library = call(global("ffi.ModuleLoadFromFile"), &path, 1, argv[1]);
  TVMFFIAny vm = call(function(library, "vm_load_executable"), NULL, 0, "vm_load_executable");
  /* the CPU, device 0, the pooled allocator (relax.VirtualMachine's defaults) */
  TVMFFIAny init[3] = {integer(kTVMFFIInt, kDLCPU), integer(kTVMFFIInt, 0), integer(kTVMFFIInt, 2)};
  call(function(vm, "vm_initialization"), init, 3, "vm_initialization");
  TVMFFIAny out = call(function(vm, "main"), inputs, n, "the model");
  if (out.type_index != kTVMFFIArray) return write_output(0, out, argv[2]);
  TVMFFIAny size = call(global("ffi.ArraySize"), &out, 1, "the outputs");
  for (int64_t i = 0; i < size.v_int64; ++i) {
    TVMFFIAny at[2] = {out, integer(kTVMFFIInt, i)};
    if (write_output((int)i, call(global("ffi.ArrayGetItem"), at, 2, "an output"), argv[2])) return 1;
  }
  return 0;
}
