// Element conversions between the float types, with the library's SIMD kernels (tierzero/simd.h
// picks the level): what a trainer uses to read or write compute-dtype buffers in fp32.
//
// Thread-safety: reentrant.
#pragma once

#include <cstddef>

#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero {

// Converts n elements between fp32, bf16 and fp16 (round to nearest even). InvalidArgument for
// other types, and for a null buffer with n > 0. The buffers must not overlap unless they are
// the same with the same type.
Status CastElements(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace tierzero
