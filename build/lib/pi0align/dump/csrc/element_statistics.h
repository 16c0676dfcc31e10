// Statistics, samples and copies of one strided block of elements (element_statistics.cpp): min,
// max, sum and sum of squares of the finite elements in float64, NaN and Inf counts, and the
// checksum of docs/dump-format.md, in one read of the memory. Each call runs now, or is queued
// for one worker thread (`queue_` entry points), which runs the queue in order beside training;
// `pi0align_wait` returns once it is empty.
//
// kind: the element kind, the index of the dtype in capture_extension.cpp's table
// (bool, uint8, int8, int16, bfloat16, float16, int32, float32, int64, float64).
// floats: min, max, sum, sum of squares; ints: NaN count, Inf count, checksum.
#pragma once

#include <cstdint>

extern "C" {
void pi0align_stats(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                    const int64_t* step, double* floats, int64_t* ints);
void pi0align_dense_stats(const void* data, int kind, int64_t numel, double* floats, int64_t* ints);
void pi0align_gather(const void* data, int kind, const int64_t* offsets, int64_t n, double* out);
void pi0align_queue_stats(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                          const int64_t* step, double* floats, int64_t* ints);
void pi0align_queue_dense_stats(const void* data, int kind, int64_t numel, double* floats, int64_t* ints);
void pi0align_queue_gather(const void* data, int kind, const int64_t* offsets, int64_t n, double* out);
void pi0align_queue_copy(const void* data, void* dest, int64_t nbytes);
void pi0align_queue_strided_copy(const void* data, int kind, int ndim, const int64_t* size, const int64_t* stride,
                                 const int64_t* step, void* dest);
void pi0align_queue_call(void (*call)(void*), void* argument);  // call(argument) in the queue's order
void pi0align_wait();
void pi0align_finished(int64_t* out);
}
