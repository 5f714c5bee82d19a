// XLA FFI handlers `jaxep_dispatch` and `jaxep_dispatch_rows` (CUDA platform): both paths of each,
// single-rank (ep_size == 1) and cross-rank (ep_size > 1, the sequence of ffi/exchange.h).
//
// The handlers take device scratch from XLA and launch the kernels of ffi/cuda/dispatch.cu on
// XLA's stream. Every output element is written by every call (XLA does not zero-initialize
// results). Shapes and attributes were checked at trace time (jaxep/ops/dispatch.py); sizes come
// from the buffers. Attributes (Config fields, identical on every rank):
//   num_sms          grid cap of the row kernels (ffi/cuda/grid.h; 0 = none)
//   dispatch_kernel  "token" | "row": the cross-rank pull kernel (ffi/cuda/dispatch.h)
//   zero_copy        peers may read x in XLA's pool instead of a staged copy
//   ranks_per_node   the node layout G (ffi/cuda/internode.h), checked against the runtime's
// Several nodes run the same handlers: Exchange adds the internode steps (the rows and layout go
// to the other nodes once, the pull reads them through each source's forwarder, team.cuh
// SourceOf). The low-latency mode has its own handlers (ffi/dispatch_ll.cc).
#include <cstdint>
#include <optional>
#include <string_view>

#include <cuda_runtime_api.h>

#include "common.h"
#include "cuda/dispatch.h"
#include "cuda/fp8.h"
#include "cuda/grid.h"
#include "exchange.h"
#include "xla/ffi/api/ffi.h"

namespace jaxep {
namespace {

namespace mr = cuda::mr;

// Carves 256-byte aligned regions out of one scratch allocation.
class Carver {
 public:
  explicit Carver(void* base) : p_(reinterpret_cast<uintptr_t>(base)) {}
  static size_t Round(size_t n) { return (n + 255) / 256 * 256; }
  void* Take(size_t n) {
    const uintptr_t at = (p_ + 255) / 256 * 256;
    p_ = at + Round(n);
    return reinterpret_cast<void*>(at);
  }

 private:
  uintptr_t p_;
};

ffi::Error AllocateScratch(ffi::ScratchAllocator& scratch, size_t bytes, void** out) {
  // XLA's FFI allocator accepts alignments up to 16 bytes; Carver aligns regions to 256 itself.
  std::optional<void*> buf = scratch.Allocate(bytes + 256, /*alignment=*/16);
  if (!buf.has_value() || *buf == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      StrCat(kDispatchTarget, ": could not allocate ", bytes,
                             " bytes of device scratch"));
  }
  *out = *buf;
  return ffi::Error::Success();
}

// The one checked switch of the attribute's names (kDispatchKernelNames).
ffi::Error ParseDispatchKernel(std::string_view name, mr::DispatchKernel* out) {
  if (name == mr::kDispatchKernelNames[0]) *out = mr::DispatchKernel::kToken;
  else if (name == mr::kDispatchKernelNames[1]) *out = mr::DispatchKernel::kRow;
  else return ffi::Error::InvalidArgument(StrCat(kDispatchTarget, ": dispatch_kernel must be "
                                                 "\"token\" or \"row\", got \"", name, "\""));
  return ffi::Error::Success();
}

// The outputs of jaxep_dispatch, as device pointers.
struct DispatchOut {
  void* x_rows;
  float* weights;
  int32_t* group_sizes;
  int32_t* send_row;
  int32_t* recv_slot;
  int32_t* topk_idx_out;
  int32_t* stats;
};

struct DispatchSizes {
  int64_t tokens, hidden, topk, experts, capacity, row_bytes, ep_size, ranks_per_node, max_blocks;
  // kNone: x_rows are x's rows as they are; else x holds the fp8 wire's packed rows (uint8,
  // row_bytes = H + H/32) and x_rows [C, H] get them dequantized to their dtype.
  cuda::Fp8Out fp8_out = cuda::Fp8Out::kNone;
};

// The fp8 wire (Config.dispatch_wire_dtype; jaxep/backends/cuda_calls.py dispatch): x uint8 [T, H + H/32]
// packed rows and x_rows [C, H] in a payload dtype, H % 128 == 0. Anything else with a uint8 x
// is a plain byte dispatch (x_rows uint8 of x's width).
ffi::Error Fp8OutOf(ffi::DataType x, int64_t x_width, ffi::DataType rows, int64_t rows_width,
                    cuda::Fp8Out* out) {
  *out = cuda::Fp8Out::kNone;
  if (x != ffi::DataType::U8 || rows == ffi::DataType::U8) {
    if (rows != x || rows_width != x_width) {
      return ffi::Error::InvalidArgument(StrCat(kDispatchTarget, ": x_rows must have x's dtype ",
                                                "and width, got ", DataTypeName(rows), " [", rows_width,
                                                "] for x ", DataTypeName(x), " [", x_width, "]"));
    }
    return ffi::Error::Success();
  }
  switch (rows) {
    case ffi::DataType::BF16: *out = cuda::Fp8Out::kBf16; break;
    case ffi::DataType::F16: *out = cuda::Fp8Out::kF16; break;
    case ffi::DataType::F32: *out = cuda::Fp8Out::kF32; break;
    default:
      return ffi::Error::InvalidArgument(StrCat(kDispatchTarget, ": x_rows of the fp8 wire must be ",
                                                "bf16, f16 or f32, got ", DataTypeName(rows)));
  }
  if (rows_width % cuda::kFp8Block != 0 || x_width != cuda::Fp8RowBytes(rows_width)) {
    return ffi::Error::InvalidArgument(StrCat(
        kDispatchTarget, ": the fp8 wire needs x [T, H + H/32] uint8 for x_rows [C, H] with ",
        "H % 128 == 0, got x width ", x_width, " and H = ", rows_width));
  }
  return ffi::Error::Success();
}

// The layout kernels' arguments: over all E experts with `capacity` rows (C on one rank; T*K,
// unbounded, for a source's local layout of a cross-rank dispatch).
cuda::DispatchLayoutArgs LayoutArgs(const DispatchSizes& s, const int32_t* topk_idx,
                                    const float* topk_weights, int64_t capacity,
                                    int32_t* topk_idx_out, int32_t* send_row, int32_t* recv_slot,
                                    float* row_weights, int32_t* group_sizes, int32_t* stats,
                                    void* scratch) {
  cuda::DispatchLayoutArgs a;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  a.num_tokens = static_cast<int32_t>(s.tokens);
  a.topk = static_cast<int32_t>(s.topk);
  a.num_experts = static_cast<int32_t>(s.experts);
  a.capacity = static_cast<int32_t>(capacity);
  a.topk_idx_out = topk_idx_out;
  a.send_row = send_row;
  a.recv_slot = recv_slot;
  a.row_weights = row_weights;
  a.group_sizes = group_sizes;
  a.stats = stats;
  a.scratch = scratch;
  return a;
}

ffi::Error SingleRankDispatch(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                              const DispatchSizes& s, const void* x, const int32_t* topk_idx,
                              const float* topk_weights, const DispatchOut& o) {
  void* buf = nullptr;
  if (ffi::Error e = AllocateScratch(
          scratch, cuda::DispatchLayoutScratchBytes(s.tokens * s.topk, s.experts), &buf);
      e.failure()) {
    return e;
  }
  const cuda::DispatchLayoutArgs a =
      LayoutArgs(s, topk_idx, topk_weights, s.capacity, o.topk_idx_out, o.send_row, o.recv_slot,
                 o.weights, o.group_sizes, o.stats, Carver(buf).Take(0));
  if (ffi::Error e = FromCuda(kDispatchTarget, "layout kernels", cuda::LaunchDispatchLayout(a, stream));
      e.failure()) {
    return e;
  }
  return FromCuda(kDispatchTarget, "row copy kernel",
                  cuda::LaunchGatherRows(x, s.tokens, s.row_bytes, o.recv_slot, s.capacity,
                                         static_cast<int32_t>(s.topk), o.x_rows, s.max_blocks,
                                         stream, s.fp8_out));
}

// A cross-rank dispatch's scratch: this source's local layout and the meta kernel's workspace.
struct CrossRankScratch {
  void* layout;          // the layout kernels' workspace
  int32_t* order;        // [T*K] index among my valid slots in (expert, slot) order
  int32_t* sorted_slot;  // [T*K] my valid slots in that order
  float* sorted_w;       // [T*K] their weights
  int32_t* counts;       // [E] my slots per expert
  int32_t* lstats;       // [2] the local layout's stats
  void* meta;            // the meta kernel's workspace
};

ffi::Error CarveCrossRankScratch(ffi::ScratchAllocator& scratch, const DispatchSizes& s,
                                 CrossRankScratch* out) {
  const int64_t slots = s.tokens * s.topk;
  const size_t layout_bytes = cuda::DispatchLayoutScratchBytes(slots, s.experts);
  const size_t ints = static_cast<size_t>(slots) * 4;
  const size_t meta_bytes = mr::DispatchMetaScratchBytes(s.ep_size, s.experts);
  void* buf = nullptr;
  if (ffi::Error e = AllocateScratch(scratch, Carver::Round(layout_bytes) + 3 * Carver::Round(ints) +
                                                  Carver::Round(s.experts * 4) + Carver::Round(8) +
                                                  Carver::Round(meta_bytes),
                                     &buf);
      e.failure()) {
    return e;
  }
  Carver c(buf);
  out->layout = c.Take(layout_bytes);
  out->order = static_cast<int32_t*>(c.Take(ints));
  out->sorted_slot = static_cast<int32_t*>(c.Take(ints));
  out->sorted_w = static_cast<float*>(c.Take(ints));
  out->counts = static_cast<int32_t*>(c.Take(s.experts * 4));
  out->lstats = static_cast<int32_t*>(c.Take(8));
  out->meta = c.Take(meta_bytes);
  return ffi::Error::Success();
}

mr::DispatchMetaArgs MetaArgs(const DispatchSizes& s, const CrossRankScratch& b,
                              const DispatchOut& o) {
  mr::DispatchMetaArgs ma;
  ma.tokens = static_cast<int32_t>(s.tokens);
  ma.topk = static_cast<int32_t>(s.topk);
  ma.experts = static_cast<int32_t>(s.experts);
  ma.capacity = static_cast<int32_t>(s.capacity);
  ma.topk_idx_out = o.topk_idx_out;
  ma.local_order = b.order;
  ma.layout_stats = b.lstats;
  ma.send_row = o.send_row;
  ma.group_sizes = o.group_sizes;
  ma.stats = o.stats;
  ma.scratch = b.meta;
  return ma;
}

// Cross-rank: this source's local layout (unbounded capacity) into scratch, then the exchange:
// stage the layout (and x unless zero-copy), meta (prefix sums over every source's counts), pull.
ffi::Error CrossRankDispatch(cudaStream_t stream, ffi::ScratchAllocator& scratch,
                             const DispatchSizes& s, const void* x, const int32_t* topk_idx,
                             const float* topk_weights, mr::DispatchKernel kernel, bool zero_copy,
                             const DispatchOut& o) {
  const int64_t slots = s.tokens * s.topk;
  Exchange ex;
  if (ffi::Error e = Exchange::Begin(kDispatchTarget, mr::kOpDispatch, s.ep_size,
                                     {slots, s.experts, s.capacity, s.tokens * s.row_bytes,
                                      s.ranks_per_node},
                                     stream, &ex);
      e.failure()) {
    return e;
  }
  CrossRankScratch b{};
  if (ffi::Error e = CarveCrossRankScratch(scratch, s, &b); e.failure()) return e;
  const size_t ints = static_cast<size_t>(slots) * 4;

  // 1. This source's layout over all E experts with unbounded capacity: order[slot] = index among
  //    my valid slots in (expert, slot) order, sorted_slot/sorted_w in that order, counts[E].
  const cuda::DispatchLayoutArgs la =
      LayoutArgs(s, topk_idx, topk_weights, slots, o.topk_idx_out, b.order, b.sorted_slot,
                 b.sorted_w, b.counts, b.lstats, b.layout);
  if (ffi::Error e = ex.Check("local layout", cuda::LaunchDispatchLayout(la, stream)); e.failure()) {
    return e;
  }
  const mr::SymLayout& lay = ex.team().lay;
  auto stage = [&](bool stage_x) {
    const mr::StageCopy copies[6] = {
        {b.sorted_slot, ints, lay.sorted_slot},
        {b.sorted_w, ints, lay.sorted_w},
        {b.counts, static_cast<size_t>(s.experts) * 4, lay.counts},
        {b.order, ints, lay.slot_order},
        {o.topk_idx_out, ints, lay.slot_expert},
        {x, static_cast<size_t>(s.tokens * s.row_bytes), lay.stage}};  // x: last
    return ex.Stage(copies, stage_x ? 6 : 5, s.max_blocks);
  };
  auto pull = [&](int32_t set) {
    // The layout (meta) once, with the first pass: it needs every source's counts, which the
    // ready exchange made complete (internode: the metadata arrived before it).
    if (set != mr::kOtherNodeSources) {
      if (ffi::Error e = ex.Check("meta", mr::LaunchDispatchMeta(ex.team(), MetaArgs(s, b, o),
                                                                 stream));
          e.failure()) {
        return e;
      }
      ex.Mark("meta");
    }
    return ex.Check("pull", mr::LaunchDispatchPull(
                                ex.team(), static_cast<int32_t>(s.tokens),
                                static_cast<int32_t>(s.topk), static_cast<int32_t>(s.experts),
                                static_cast<int32_t>(s.capacity), s.row_bytes, b.meta, o.x_rows,
                                o.weights, o.recv_slot, kernel, set, s.max_blocks, stream,
                                s.fp8_out));
  };
  // Other nodes get every layout array (their meta kernels need my counts) and my rows that
  // need them (ffi/cuda/internode.h).
  InterNode inter;
  inter.meta_off = lay.counts;
  inter.meta_bytes = lay.meta_span;
  inter.rows = true;
  inter.row_bytes = s.row_bytes;
  inter.tokens = static_cast<int32_t>(s.tokens);
  inter.topk = static_cast<int32_t>(s.topk);
  inter.experts = static_cast<int32_t>(s.experts);
  return ex.Run(x, s.tokens * s.row_bytes, zero_copy, stage, pull, inter);
}

ffi::Error DispatchImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32, 2> topk_idx, ffi::Buffer<ffi::F32, 2> topk_weights,
                        int64_t num_experts, int64_t capacity, int64_t ep_size,
                        int64_t ranks_per_node, int64_t num_sms,
                        std::string_view dispatch_kernel, bool zero_copy,
                        ffi::Result<ffi::AnyBuffer> x_rows,
                        ffi::ResultBuffer<ffi::F32, 1> weights,
                        ffi::ResultBuffer<ffi::S32, 1> group_sizes,
                        ffi::ResultBuffer<ffi::S32, 2> send_row,
                        ffi::ResultBuffer<ffi::S32, 1> recv_slot,
                        ffi::ResultBuffer<ffi::S32, 2> topk_idx_out,
                        ffi::ResultBuffer<ffi::S32, 1> stats) {
  DispatchSizes s{};
  s.tokens = x.dimensions()[0];
  s.hidden = x.dimensions()[1];
  s.topk = topk_idx.dimensions()[1];
  s.experts = num_experts;
  s.capacity = capacity;
  s.ep_size = ep_size;
  s.ranks_per_node = ranks_per_node;
  s.max_blocks = cuda::MaxBlocksForSms(num_sms);
  if (ffi::Error e = DispatchRowBytes(kDispatchTarget, "x", x.element_type(), s.hidden,
                                      &s.row_bytes);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = Fp8OutOf(x.element_type(), s.hidden, x_rows->element_type(),
                              x_rows->dimensions()[1], &s.fp8_out);
      e.failure()) {
    return e;
  }
  mr::DispatchKernel kernel = mr::DispatchKernel::kToken;
  if (ffi::Error e = ParseDispatchKernel(dispatch_kernel, &kernel); e.failure()) return e;
  const DispatchOut o{x_rows->untyped_data(),     weights->typed_data(),
                      group_sizes->typed_data(),  send_row->typed_data(),
                      recv_slot->typed_data(),    topk_idx_out->typed_data(),
                      stats->typed_data()};
  if (ep_size == 1) {
    return SingleRankDispatch(stream, scratch, s, x.untyped_data(), topk_idx.typed_data(),
                              topk_weights.typed_data(), o);
  }
  return CrossRankDispatch(stream, scratch, s, x.untyped_data(), topk_idx.typed_data(),
                           topk_weights.typed_data(), kernel, zero_copy, o);
}

// Row copy only: x_rows[c] = x[token of recv_slot[c]] (on its source rank when ep_size > 1), zero
// rows where recv_slot[c] is -1 (or outside the slots, which a well-formed handle never holds).
// x is a payload dtype's rows, or uint8 byte rows (the per-token extras, jaxep/ops/_carry.py):
// the row kernels copy bytes whatever the dtype.
ffi::Error DispatchRowsImpl(cudaStream_t stream, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32, 1> recv_slot, ffi::Buffer<ffi::S32, 2> send_row,
                            ffi::Buffer<ffi::S32, 2> topk_idx, int64_t num_experts,
                            int64_t ep_size, int64_t ranks_per_node, int64_t topk,
                            int64_t num_sms, bool zero_copy, ffi::Result<ffi::AnyBuffer> x_rows) {
  const int64_t tokens = x.dimensions()[0];
  const int64_t rows = recv_slot.dimensions()[0];
  const int64_t max_blocks = cuda::MaxBlocksForSms(num_sms);
  int64_t row_bytes = 0;
  if (ffi::Error e = DispatchRowBytes(kDispatchRowsTarget, "x", x.element_type(),
                                      x.dimensions()[1], &row_bytes);
      e.failure()) {
    return e;
  }
  const void* xp = x.untyped_data();
  void* out = x_rows->untyped_data();
  if (ep_size == 1) {
    return FromCuda(kDispatchRowsTarget, "row copy kernel",
                    cuda::LaunchGatherRows(xp, tokens, row_bytes, recv_slot.typed_data(), rows,
                                           static_cast<int32_t>(topk), out, max_blocks, stream));
  }
  Exchange ex;
  if (ffi::Error e = Exchange::Begin(kDispatchRowsTarget, mr::kOpDispatchRows, ep_size,
                                     {tokens * topk, 0, rows, tokens * row_bytes, ranks_per_node},
                                     stream, &ex);
      e.failure()) {
    return e;
  }
  const mr::SymLayout& lay = ex.team().lay;
  const size_t ints = static_cast<size_t>(tokens * topk) * 4;
  auto stage = [&](bool stage_x) {
    // With several nodes the handle tells the other nodes which of my tokens they need.
    const mr::StageCopy copies[3] = {{send_row.typed_data(), ints, lay.slot_order},
                                     {topk_idx.typed_data(), ints, lay.slot_expert},
                                     {xp, static_cast<size_t>(tokens * row_bytes), lay.stage}};
    const int first = ex.internode() ? 0 : 2;
    const int last = stage_x ? 3 : 2;
    return ex.Stage(copies + first, last - first, max_blocks);
  };
  auto pull = [&](int32_t set) {
    return ex.Check("pull", mr::LaunchRowsPull(ex.team(), static_cast<int32_t>(tokens),
                                               static_cast<int32_t>(topk),
                                               static_cast<int32_t>(rows), row_bytes,
                                               recv_slot.typed_data(), out, set, max_blocks,
                                               stream));
  };
  InterNode inter;
  inter.meta_off = lay.slot_order;
  inter.meta_bytes = lay.counts + lay.meta_span - lay.slot_order;  // slot_order, slot_expert
  inter.rows = true;
  inter.row_bytes = row_bytes;
  inter.tokens = static_cast<int32_t>(tokens);
  inter.topk = static_cast<int32_t>(topk);
  inter.experts = static_cast<int32_t>(num_experts);
  return ex.Run(xp, tokens * row_bytes, zero_copy, stage, pull, inter);
}

}  // namespace
}  // namespace jaxep

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepDispatch, jaxep::DispatchImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Ctx<xla::ffi::ScratchAllocator>()                 // device scratch for the layout scan
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K]
        .Arg<jaxep::F32Mat>()                              // topk_weights [T, K]
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("capacity")                         // C, receive rows per rank
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Attr<int64_t>("ranks_per_node")                   // G, the node layout (R: one node)
        .Attr<int64_t>("num_sms")                          // Config.num_sms (0: no grid cap)
        .Attr<std::string_view>("dispatch_kernel")         // Config.dispatch_kernel
        .Attr<bool>("zero_copy")                           // Config.zero_copy
        .Ret<xla::ffi::AnyBuffer>()                        // x_rows [C, H], dtype of x
        .Ret<jaxep::F32Vec>()                              // weights [C]
        .Ret<jaxep::S32Vec>()                              // group_sizes [L]
        .Ret<jaxep::S32Mat>()                              // send_row [T, K]
        .Ret<jaxep::S32Vec>()                              // recv_slot [C]
        .Ret<jaxep::S32Mat>()                              // topk_idx_out [T, K]
        .Ret<jaxep::S32Vec>());                            // stats [2] {dropped, invalid}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxepDispatchRows, jaxep::DispatchRowsImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()     // XLA's compute stream
        .Arg<xla::ffi::AnyBuffer>()                        // x [T, H] bf16|f16|f32|u8
        .Arg<jaxep::S32Vec>()                              // recv_slot [C] (handle)
        .Arg<jaxep::S32Mat>()                              // send_row [T, K] (handle)
        .Arg<jaxep::S32Mat>()                              // topk_idx [T, K] sanitized (handle)
        .Attr<int64_t>("num_experts")                      // E
        .Attr<int64_t>("ep_size")                          // R, EP axis size
        .Attr<int64_t>("ranks_per_node")                   // G, the node layout (R: one node)
        .Attr<int64_t>("topk")                             // K (slot id / K = token)
        .Attr<int64_t>("num_sms")                          // Config.num_sms (0: no grid cap)
        .Attr<bool>("zero_copy")                           // Config.zero_copy
        .Ret<xla::ffi::AnyBuffer>());                      // x_rows [C, H], dtype of x
