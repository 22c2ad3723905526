// Test/benchmark helper: keep a stream busy for a given time.
//
// Tests put it ahead of a transfer so that a missing device-side wait would
// read stale bytes for sure; benchmarks put it ahead of many small memcpys so
// the GPU, not Python's submission rate, is what gets timed.
extern "C" __global__ void kvflow_spin(const long long nanoseconds) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= static_cast<unsigned long long>(nanoseconds)) break;
    __nanosleep(1000);
  }
}
