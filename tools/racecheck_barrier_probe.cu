// Which CTA barrier forms compute-sanitizer's racecheck follows: the hand-off Triton's warp specialization
// lowers to (tools/racecheck_probe.py mode 0), in plain CUDA. 8 warps; warps 0-3 (Triton's default partition)
// each store a 4-byte state word (one byte per worker warp, as Triton's st.shared.b32), a barrier of all 256
// threads, warps 4-7 read their byte; a second round writes a new state after two more barriers (Triton's exit).
// FORM picks the barrier: 0 `barrier.sync 1;` (Triton's: non-aligned, no thread count), 1 `barrier.sync 1, 256;`,
// 2 `bar.sync 1;`, 3 `bar.sync 1, 256;`, 4 __syncthreads(), 5 form 0 with the default warps' own `bar.sync 0, 128`
// before each state store (Triton's full sequence), 6 form 5 with that barrier on id 2 (`bar.sync 2, 128`).
//   nvcc -arch=sm_90a -lineinfo -o probe racecheck_barrier_probe.cu && compute-sanitizer --tool racecheck ./probe FORM
#include <cstdio>
#include <cstdlib>

template <int FORM>
__device__ __forceinline__ void cta_barrier() {
  if (FORM == 0 || FORM == 5 || FORM == 6) asm volatile("barrier.sync 1;" ::: "memory");
  if (FORM == 1) asm volatile("barrier.sync 1, 256;" ::: "memory");
  if (FORM == 2) asm volatile("bar.sync 1;" ::: "memory");
  if (FORM == 3) asm volatile("bar.sync 1, 256;" ::: "memory");
  if (FORM == 4) __syncthreads();
}

template <int FORM>
__global__ void probe(int* out) {
  __shared__ unsigned int state;
  const int warp = threadIdx.x / 32;
  int seen = 0;
  for (int round = 0; round < 2; ++round) {
    if (warp < 4) {
      if (FORM == 5) asm volatile("bar.sync 0, 128;" ::: "memory");
      if (FORM == 6) asm volatile("bar.sync 2, 128;" ::: "memory");
      state = 0x01010101u * (round + 1);
      cta_barrier<FORM>();  // release the workers
      cta_barrier<FORM>();  // the workers are done
    } else {
      cta_barrier<FORM>();
      seen += reinterpret_cast<volatile unsigned char*>(&state)[warp - 4];
      cta_barrier<FORM>();
    }
  }
  if (warp >= 4 && (threadIdx.x % 32) == 0) out[warp - 4] = seen;
}

int main(int argc, char** argv) {
  const int form = argc > 1 ? atoi(argv[1]) : 0;
  int* out;
  cudaMalloc(&out, 4 * sizeof(int));
  switch (form) {
    case 0: probe<0><<<1, 256>>>(out); break;
    case 1: probe<1><<<1, 256>>>(out); break;
    case 2: probe<2><<<1, 256>>>(out); break;
    case 3: probe<3><<<1, 256>>>(out); break;
    case 5: probe<5><<<1, 256>>>(out); break;
    case 6: probe<6><<<1, 256>>>(out); break;
    default: probe<4><<<1, 256>>>(out); break;
  }
  int host[4];
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  const bool ok = host[0] == 3 && host[1] == 3 && host[2] == 3 && host[3] == 3;
  printf("form %d: values %s (%d %d %d %d)\n", form, ok ? "right" : "WRONG", host[0], host[1], host[2], host[3]);
  return ok ? 0 : 1;
}
