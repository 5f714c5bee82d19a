// The internode transport every cross-rank op shares (hierarchical, like DeepEP / HybridEP):
// every NVSHMEM put of the normal mode is in internode.cu or internode.cuh (the low-latency ones:
// low_latency.cuh). Plain C++ interface: no XLA, JAX or NVSHMEM types.
//
// Node layout: rank = node * G + local index (Team::node_size = G). A rank exchanges with other
// nodes only through its "peers" there: rank (n, my local index) of each other node n. Peer n
// hosts a region for me (SymLayout) and I host one for it. What crosses the network:
//   dispatch, dispatch_rows: my token rows that need node n (one put per token and node: a token
//     crosses the network at most once per destination node), into my region on peer n, which
//     then serves as my rows' source for every rank of node n (they read it over NVLink through
//     peer n's peer pointer: the forwarding hop), plus my metadata (layout arrays or handle);
//   combine, gather_back: my handle's metadata to peer n; peer n's node reduces / gathers what my
//     tokens need from it and peer n puts ONE result per (token, node) back into the region I host
//     for it (combine: the partial P_n in Config.combine_wire_dtype).
//
// The steps, inside ffi/exchange.h's sequence (all on XLA's stream, bounded waits):
//   2b GRANT   after the free wait (my node's readers left my regions): reset my rin_rows
//              (return) counters, then signal credit[my node] = seq on every peer ("you may
//              write this call");
//   3b SEND    out_pos / out_count (which of my tokens need node n), WAIT credit[n] >= seq (peer n's
//              region for me is free), then put my metadata (signal rin_meta = seq) and, for
//              the row ops, my rows into it: row j (my j-th token that needs node n) with the
//              signal rin_seq[my node][j] = seq on peer n;
//   4a ARRIVE  per peer n: WAIT rin_meta[n] >= seq, recompute peer n's out_pos for my node into
//              its region (region_pos / region_count); then the ready signal tells my node's
//              ranks my stage and my regions' metadata are complete;
//   OVERLAP    row ops: the pull of my node's sources runs while the other nodes' rows are still
//              in flight (puts are non-blocking), then the pull of the other nodes' sources
//              (exchange.h), pipelined row by row: a warp that copies row j of source s (node n)
//              from its forwarder f = (my node, s's local index) first WAITs f's
//              rin_seq[n][j] >= seq (team.cuh AwaitRemoteRow), so each row is forwarded over
//              NVLink as soon as it landed on f while the others are still on the network. No
//              rank waits for all of its regions' rows, and there is no node-wide exchange after
//              the ready one. Why this is safe:
//                - NVSHMEM delivers a put's data before its signal; the reader loads the signal
//                  with ld.acquire.sys through f's peer pointer and only then the row, so it reads
//                  the row's data of this call (on a real cluster: the NIC's writes into f's
//                  memory are ordered at f, where the NVLink loads are served too);
//                - the flag holds a seq and never goes back: s's puts of one call are complete
//                  (nvshmem_quiet) before its next call's, and s writes into f's region again only
//                  after f's grant of that call, i.e. after every reader of my node signalled
//                  free for this one (2b) - so the flag needs no reset, a late row that nobody
//                  reads (its slots dropped for capacity everywhere) cannot disturb a later call,
//                  and no row is overwritten while a reader copies it;
//                - region_pos / the metadata the pull reads on f are complete since the ready
//                  exchange (4a precedes f's ready signal); no pull kernel waits for anything a
//                  later kernel of any stream produces: the row puts of s are issued by its send
//                  kernel, which had started before f's ready (f waited s's metadata, put by the
//                  same kernel), and that kernel waits for nothing after its credit (with
//                  several ranks on one GPU this also relies on the block scheduler serving an
//                  earlier grid's pending blocks before a later grid's: the spinning pull is
//                  launched after the send kernel it waits for);
//   5  RETURN  combine, gather_back: what my node computes for each of peer n's tokens that need
//              it goes back to peer n by put, into the region I own there.
//              gather_back: its kernel writes region n's out area, LaunchReturnPuts puts one
//              result per warp (signal rin_rows += 1 each), and WAIT-RETURNS
//              (LaunchAwaitReturns) waits rin_rows[n] >= my out_count[n].
//              combine (streaming): the reducer's block that wrote a chunk of kReturnChunk
//              consecutive tokens' partials puts them at once, one put whose signal SETs
//              rin_seq[my node][chunk] = seq on peer n (internode.cuh PutReturnChunk), and my
//              final pull waits, per token, for the chunk flags of the nodes that hold its
//              partials (AwaitReturnChunks) before adding them: the returns overlap the reduction
//              and the final pull, and there is no count wait. The chunk words are the rin_seq
//              words dispatch uses as row flags: the same peer writes both, only ever its
//              latest call's seq, and its calls are ordered (quiet at each kernel's end; credit).
// Flow control: a writer puts into a region only after the host granted this call (3b waits the
// credit), and a host grants only after its node's readers signalled free for the last call
// (step 2), so regions sized from the Config never overflow or get overwritten while read, for
// any routing. Returns need no credit wait: peer n returns only after my metadata of this call
// arrived, which I sent after granting (2b).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "sync.h"

namespace jaxep::cuda::mr {

// Step 2b. No-op with one node.
cudaError_t LaunchGrant(const Team& team, uint64_t seq, int32_t op, cudaStream_t stream);

// Step 3b. `meta_off`/`meta_bytes`: the span of my block the peers get, inside [counts,
// slot_expert end) (dispatch: all of it; the others: slot_order and slot_expert, where they staged
// their handle's send_row and topk_idx). `rows`: my token rows at their local address in NVSHMEM's
// symmetric heap or a registered pool (nullptr: the op sends no rows), `row_bytes` each.
struct SendArgs {
  int32_t tokens = 0, topk = 0, experts = 0;
  size_t meta_off = 0, meta_bytes = 0;
  const void* rows = nullptr;
  int64_t row_bytes = 0;
};
// In two launches, so the phase timer (ffi/phase_times.h) tells the wait from the puts:
// LaunchSendCredit computes my positions for every other node and waits every peer's credit;
// LaunchSendPuts then puts the metadata and the rows.
cudaError_t LaunchSendCredit(const Team& team, const SendArgs& a, uint64_t seq, int32_t op,
                             cudaStream_t stream);
cudaError_t LaunchSendPuts(const Team& team, const SendArgs& a, uint64_t seq, int64_t max_blocks,
                           cudaStream_t stream);

// Step 4a: every peer's metadata, and its positions for my node (region_pos / region_count).
cudaError_t LaunchArrive(const Team& team, int32_t tokens, int32_t topk, int32_t experts,
                         uint64_t seq, int32_t op, cudaStream_t stream);

// Step 5: LaunchReturnPuts puts region n's first region_count[n] results of `bytes` each to peer
// n; LaunchAwaitReturns then WAITS until my own out_count[n] results came back from every peer n.
cudaError_t LaunchReturnPuts(const Team& team, int64_t bytes, int64_t max_blocks,
                             cudaStream_t stream);
cudaError_t LaunchAwaitReturns(const Team& team, uint64_t seq, int32_t op, cudaStream_t stream);

}  // namespace jaxep::cuda::mr
