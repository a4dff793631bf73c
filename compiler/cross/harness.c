/* Runs one tvmattn kernel (a TVM-FFI function compiled into an object file and linked in statically)
 * on arrays read from files, and writes its output to a file: how a kernel cross-compiled for another
 * CPU is checked under qemu-user (`tvmattn.compiler.cross.emulate`).
 *
 *   harness CODE:BITS:D0,D1,...:FILE ...      the kernel's arguments in order; the last one is written
 *
 * The kernel reaches its runtime only through the context symbols below (TVM's library loader sets
 * them in a shared library); here the parallel launch runs each task on a thread. */
#include <pthread.h>

#include "arrays.h"

#define MAX_ARGS 32

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;
typedef int (*ParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);

/* TVM's num_task 0: as many tasks as the pool has workers, each taking its share of the loop (three
 * here: an odd count checks the uneven split a real pool makes) */
#define POOL_TASKS 3

typedef struct {
  ParallelLambda lambda;
  TVMParallelGroupEnv* env;
  void* cdata;
  int task;
  int rc;
} Task;

static void* run_task(void* arg) {
  Task* t = (Task*)arg;
  t->rc = t->lambda(t->task, t->env, t->cdata);
  return NULL;
}

/* Each task on a thread of its own, as TVM's pool runs them: a kernel that widens or packs operands
 * in one stage and reads them in the next waits at a barrier between the two, which tasks run one
 * after another could not pass. */
static int parallel_launch(ParallelLambda lambda, void* cdata, int num_task) {
  if (num_task <= 0) num_task = POOL_TASKS;
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, (unsigned)num_task);
  TVMParallelGroupEnv env = {&barrier, num_task};
  Task* tasks = calloc((size_t)num_task, sizeof(Task));
  pthread_t* threads = calloc((size_t)num_task, sizeof(pthread_t));
  int rc = 0;
  for (int i = 0; i < num_task; ++i) {
    tasks[i] = (Task){lambda, &env, cdata, i, 0};
    if (pthread_create(&threads[i], NULL, run_task, &tasks[i]) != 0) return -1;
  }
  for (int i = 0; i < num_task; ++i) {
    pthread_join(threads[i], NULL);
    if (tasks[i].rc != 0) rc = tasks[i].rc;
  }
  pthread_barrier_destroy(&barrier);
  free(tasks);
  free(threads);
  return rc;
}

static int parallel_barrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id;
  pthread_barrier_wait((pthread_barrier_t*)penv->sync_handle);
  return 0;
}

static void* alloc_workspace(int device_type, int device_id, uint64_t nbytes, int code_hint, int bits_hint) {
  (void)device_type; (void)device_id; (void)code_hint; (void)bits_hint;
  return aligned_bytes(nbytes);
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type; (void)device_id;
  free(ptr);
  return 0;
}

/* the kernel's context symbols (weak, null in its object file): strong definitions win */
void* __TVMBackendParallelLaunch = (void*)parallel_launch;
void* __TVMBackendParallelBarrier = (void*)parallel_barrier;
void* __TVMBackendAllocWorkspace = (void*)alloc_workspace;
void* __TVMBackendFreeWorkspace = (void*)free_workspace;

void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* message) {
  fprintf(stderr, "kernel error: %s: %s\n", kind, message);
}

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  fprintf(stderr, "kernel error: %s: ", kind);
  for (int32_t i = 0; i < num_parts; ++i)
    if (parts[i] != NULL) fputs(parts[i], stderr);
  fputc('\n', stderr);
}

int __tvm_ffi_main(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result);

int main(int argc, char** argv) {
  static DLTensor tensors[MAX_ARGS];
  static int64_t shapes[MAX_ARGS][MAX_DIMS];
  static TVMFFIAny packed[MAX_ARGS];
  size_t bytes[MAX_ARGS];
  char* paths[MAX_ARGS];
  int n = argc - 1;
  if (n < 1 || n > MAX_ARGS) {
    fprintf(stderr, "usage: %s CODE:BITS:D0,D1,...:FILE ... (the last argument is the output)\n", argv[0]);
    return 2;
  }
  for (int i = 0; i < n; ++i) {
    bytes[i] = parse_array(argv[i + 1], &tensors[i], shapes[i], &paths[i]);
    tensors[i].data = aligned_bytes(bytes[i]);
    if (bytes[i] == 0 || tensors[i].data == NULL) {
      fprintf(stderr, "argument %d: cannot read %s\n", i, argv[i + 1]);
      return 2;
    }
    if (i < n - 1 && read_array(paths[i], tensors[i].data, bytes[i])) return 2;
    packed[i].type_index = kTVMFFIDLTensorPtr;
    packed[i].zero_padding = 0;
    packed[i].v_ptr = &tensors[i];
  }
  TVMFFIAny result;
  memset(&result, 0, sizeof(result));
  result.type_index = kTVMFFINone;
  if (__tvm_ffi_main(NULL, packed, n, &result) != 0) return 1;
  return write_array(paths[n - 1], tensors[n - 1].data, bytes[n - 1]) ? 2 : 0;
}
