/* vdpbf16ps (32 products) against vfmadd231ps (16 products) on this core: one dependent chain (latency)
 * and 8 independent accumulators (throughput), ns per instruction. Built and run by
 * scripts/amx_epilogue.py (the README's decode paragraph). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define CH 8
int main(void) {
  const long N = 100000000;
  __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1.0f);
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x0001);
  __m512 f = _mm512_setzero_ps(), d = _mm512_setzero_ps(), s = _mm512_setzero_ps(), c[CH];
  double t = now();
  for (long i = 0; i < N; i++) { f = _mm512_fmadd_ps(f, b, a); __asm__ volatile("" : "+v"(f)); }
  double fma_dep = (now() - t) / N;
  t = now();
  for (long i = 0; i < N; i++) { d = _mm512_dpbf16_ps(d, x, y); __asm__ volatile("" : "+v"(d)); }
  double dot_dep = (now() - t) / N;
  for (int j = 0; j < CH; j++) c[j] = _mm512_setzero_ps();
  t = now();
  for (long i = 0; i < N / CH; i++) {
#pragma GCC unroll 8
    for (int j = 0; j < CH; j++) c[j] = _mm512_dpbf16_ps(c[j], x, y);
  }
  double dot_ind = (now() - t) / N;
  for (int j = 0; j < CH; j++) { s = _mm512_add_ps(s, c[j]); c[j] = _mm512_setzero_ps(); }
  t = now();
  for (long i = 0; i < N / CH; i++) {
#pragma GCC unroll 8
    for (int j = 0; j < CH; j++) c[j] = _mm512_fmadd_ps(c[j], b, a);
  }
  double fma_ind = (now() - t) / N;
  for (int j = 0; j < CH; j++) s = _mm512_add_ps(s, c[j]);
  printf("vdpbf16ps: %.3f ns dependent, %.3f ns with %d accumulators (32 products each)\n", 1e9 * dot_dep, 1e9 * dot_ind, CH);
  printf("vfmadd231ps: %.3f ns dependent, %.3f ns with %d accumulators (16 products each)\n", 1e9 * fma_dep, 1e9 * fma_ind, CH);
  float o[16]; _mm512_storeu_ps(o, _mm512_add_ps(s, _mm512_add_ps(f, d)));
  return o[0] > 1e30f;
}
