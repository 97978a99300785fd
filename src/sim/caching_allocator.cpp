// See Note [Caching allocator replay] in caching_allocator.h for what is mirrored
// from PyTorch's CUDACachingAllocator.cpp and what is left out.

#include "caching_allocator.h"

#include <algorithm>
#include <bit>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>

namespace trainmem::sim {

namespace {

constexpr std::uint64_t kMaxBytes = std::numeric_limits<std::uint64_t>::max();

// Rounds `bytes` up to a multiple of `step` (a power of two); false on overflow.
bool round_up(std::uint64_t bytes, std::uint64_t step, std::uint64_t& out) noexcept {
  const std::uint64_t below = bytes & ~(step - 1);
  if (below == bytes) {
    out = bytes;
    return true;
  }
  if (below > kMaxBytes - step) return false;
  out = below + step;
  return true;
}

// Same for steps that are not powers of two (the 20 MiB large page).
bool round_up_any(std::uint64_t bytes, std::uint64_t step, std::uint64_t& out) noexcept {
  const std::uint64_t rem = bytes % step;
  if (rem == 0) {
    out = bytes;
    return true;
  }
  const std::uint64_t pad = step - rem;
  if (bytes > kMaxBytes - pad) return false;
  out = bytes + pad;
  return true;
}

[[noreturn]] void bug(const char* what) {
  // An invariant of the model broke: this is never caused by the caller's input.
  throw std::logic_error(std::string("trainmem bug in the caching allocator model: ") + what +
                         "; please report it");
}

}  // namespace

void* CachingAllocator::NodePool::take() {
  if (free_ != nullptr) {
    Slot* slot = free_;
    free_ = slot->next;
    return slot;
  }
  if (used_in_last_chunk_ == kChunkSlots) {
    chunks_.push_back(std::make_unique_for_overwrite<Slot[]>(kChunkSlots));
    used_in_last_chunk_ = 0;
  }
  return &chunks_.back()[used_in_last_chunk_++];
}

void CachingAllocator::NodePool::give(void* slot) noexcept {
  Slot* s = static_cast<Slot*>(slot);
  s->next = free_;
  free_ = s;
}

CachingAllocator::CachingAllocator(AllocatorConfig config)
    : config_(config),
      unmapped_{UnmappedSet(NodeAllocator<AddressKey>(&node_pool_)),
                UnmappedSet(NodeAllocator<AddressKey>(&node_pool_))} {
  validate(config_);
}

void CachingAllocator::validate(const AllocatorConfig& config) {
  const unsigned div = config.roundup_power2_divisions;
  if (div != 0 && !std::has_single_bit(div)) {
    throw std::invalid_argument("roundup_power2_divisions=" + std::to_string(div) +
                                " is not a power of two; use 0 (off), 1, 2, 4, 8 or 16");
  }
  if (config.max_split_size_bytes < kLargeSegmentBytes) {
    throw std::invalid_argument("max_split_size_bytes=" +
                                std::to_string(config.max_split_size_bytes) +
                                " is below the 20971520-byte (20 MiB) minimum; use at least "
                                "20 MiB, or UINT64_MAX for no limit");
  }
  if (config.max_non_split_rounding_bytes < kLargeSegmentBytes) {
    throw std::invalid_argument("max_non_split_rounding_bytes=" +
                                std::to_string(config.max_non_split_rounding_bytes) +
                                " is below the 20971520-byte (20 MiB) minimum; use at least "
                                "20 MiB");
  }
}

void CachingAllocator::reset(AllocatorConfig config) {
  validate(config);
  reset();
  config_ = config;
}

CachingAllocator::~CachingAllocator() = default;

// ---- sizing (round_size, roundup_power2_next_division, get_allocation_size) ----

std::uint64_t CachingAllocator::round_up_power2_division(std::uint64_t bytes,
                                                         unsigned divisions) {
  if (bytes == 0 || std::has_single_bit(bytes)) return bytes;
  if (divisions < 2 || !std::has_single_bit(divisions)) {
    throw std::invalid_argument("roundup_power2_divisions=" + std::to_string(divisions) +
                                " must be a power of two of at least 2 here");
  }
  const std::uint64_t floor = std::bit_floor(bytes);
  const std::uint64_t step = floor / divisions;
  // A step of zero means the interval has fewer bytes than divisions: PyTorch
  // then goes straight to the next power of two (which cannot overflow here,
  // since floor < 2^63 whenever step is zero).
  if (step == 0) return floor << 1;
  std::uint64_t out = 0;
  if (!round_up(bytes, step, out)) {
    throw std::overflow_error("cannot round a request of " + std::to_string(bytes) +
                              " bytes up to the next 1/" + std::to_string(divisions) +
                              " power-of-two step: the result does not fit in 64 bits");
  }
  return out;
}

std::uint64_t CachingAllocator::round_size(std::uint64_t bytes, const AllocatorConfig& config) {
  if (bytes < kMinBlockBytes) return kMinBlockBytes;
  const unsigned div = config.roundup_power2_divisions;
  // The guard keeps the step at 512 B or more: below 512 × divisions the plain
  // 512 B rounding applies even when divisions are configured.
  if (div > 1 && bytes > kMinBlockBytes * div) return round_up_power2_division(bytes, div);
  std::uint64_t out = 0;
  if (!round_up(bytes, kMinBlockBytes, out)) {
    throw std::overflow_error("cannot round a request of " + std::to_string(bytes) +
                              " bytes up to a multiple of 512 bytes: the result does not fit "
                              "in 64 bits");
  }
  return out;
}

std::uint64_t CachingAllocator::allocation_size(std::uint64_t rounded_bytes) {
  if (rounded_bytes <= kSmallRequestMaxBytes) return kSmallSegmentBytes;
  if (rounded_bytes < kMinLargeAllocBytes) return kLargeSegmentBytes;
  std::uint64_t out = 0;
  if (!round_up(rounded_bytes, kLargeRoundBytes, out)) {
    throw std::overflow_error("cannot size a segment for a block of " +
                              std::to_string(rounded_bytes) +
                              " bytes: rounding up to a multiple of 2097152 bytes does not fit "
                              "in 64 bits");
  }
  return out;
}

std::uint64_t CachingAllocator::page_bytes(Pool pool) noexcept {
  return pool == kSmallPool ? kSmallPageBytes : kLargePageBytes;
}

// should_split. With expandable segments every remainder of 512 B or more is
// split, whatever max_split_size says.
bool CachingAllocator::should_split(Pool pool, std::uint64_t size,
                                    std::uint64_t remaining) const noexcept {
  if (pool == kSmallPool || config_.expandable_segments) return remaining >= kMinBlockBytes;
  return size < config_.max_split_size_bytes && remaining > kSmallRequestMaxBytes;
}

// ---- block storage ----

CachingAllocator::BlockId CachingAllocator::new_block() {
  BlockId id;
  if (!reusable_ids_.empty()) {
    id = reusable_ids_.back();
    reusable_ids_.pop_back();
    blocks_[id] = Block{};
  } else {
    if (blocks_.size() >= kNoBlock) {
      throw std::length_error("the caching allocator model ran out of 32-bit block ids");
    }
    id = static_cast<BlockId>(blocks_.size());
    blocks_.emplace_back();
  }
  blocks_[id].live = true;
  return id;
}

void CachingAllocator::recycle(BlockId id) noexcept {
  blocks_[id].live = false;
  reusable_ids_.push_back(id);
}

bool CachingAllocator::is_live_allocation(BlockId id) const noexcept {
  return id < blocks_.size() && blocks_[id].live && blocks_[id].allocated;
}

// ---- FreeIndex ----
// Note [Free buckets that stay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Best fit is the lowest address of the smallest cached size at least the request's, on its
// stream. Entries of a size are kept by descending address, so that block is the last entry of
// its list and taking it moves nothing.
//
// The lists were kept in a sorted vector of buckets and a bucket was dropped as soon as it
// emptied: every insert, take and erase began with a binary search over the pool's buckets
// (~45 instructions), and a 70B replay made and dropped ~8,100 buckets (a size whose one free
// block is taken, then freed again). Now a bucket, once made, stays until clear() whether it
// holds blocks or not, and is found by its (stream, size) in a hash table (open addressing,
// linear probing, at most a quarter full): a free or an erase names a size that has a bucket,
// and so does nearly every request once the first layers have run. The buckets are also kept in
// (stream, size) order, with a bit per bucket that says whether it holds blocks; best fit is then
// the request's own bucket when it holds blocks (no cached size lies between the request and
// itself), otherwise the next set bit after the request's place in that order, found in whole
// 64-bit words. Only a size never seen before needs the ordered search, to place its bucket.
// The answer is the one a search over the buckets that hold blocks gives: those are exactly the
// set bits, in the same order.
//
// Making a bucket moves the places in that order of the buckets above it; instead of rewriting
// them, it starts a new epoch, and a bucket's place from an older epoch is searched again the
// next time it is needed (rank_of): once no new size comes, each place is searched at most once.
//
// Empty buckets cost nothing but room and the bits skipped; a replay sees a few hundred sizes
// (205 for the 70B step, both pools). With expandable segments almost every split leaves a
// remainder of a new size, so when the buckets in order pass kEmptyBucketsKept and fewer than a
// quarter of them hold blocks, the empty ones are given up at once (rebuild) and their lists
// kept for the next new sizes.

CachingAllocator::FreeIndex::FreeIndex() : slots_(64, Slot{0, 0, kNoBucket}), slot_shift_(64 - 6) {}

std::size_t CachingAllocator::FreeIndex::rank_at_least(int stream, std::uint64_t size) const noexcept {
  const auto it = std::lower_bound(order_.begin(), order_.end(), std::pair{stream, size},
                                   [](const Slot& b, const std::pair<int, std::uint64_t>& k) {
                                     return b.stream != k.first ? b.stream < k.first : b.size < k.second;
                                   });
  return static_cast<std::size_t>(it - order_.begin());
}

std::size_t CachingAllocator::FreeIndex::next_filled(std::size_t rank) const noexcept {
  std::size_t w = rank / 64;
  if (w >= filled_.size()) return order_.size();
  std::uint64_t bits = filled_[w] & (~0ull << (rank % 64));
  while (bits == 0) {
    if (++w == filled_.size()) return order_.size();
    bits = filled_[w];
  }
  return w * 64 + static_cast<std::size_t>(std::countr_zero(bits));
}

// Remakes the ranks, the bits and the hash table from order_: from all of it, or (only_filled)
// from the buckets holding blocks, the others going back to spare_.
void CachingAllocator::FreeIndex::rebuild(bool only_filled) {
  if (only_filled) {
    std::size_t kept = 0;
    for (const Slot& k : order_) {
      if (buckets_[k.bucket].entries.empty()) {
        spare_.push_back(k.bucket);
      } else {
        order_[kept++] = k;
      }
    }
    order_.resize(kept);
  }
  ++epoch_;
  filled_.assign((order_.size() + 63) / 64, 0);
  filled_count_ = 0;
  std::size_t slots = 64;
  std::uint32_t shift = 64 - 6;
  while (order_.size() * 4 > slots || slots < slots_.size()) {
    slots *= 2;
    --shift;
  }
  slots_.assign(slots, Slot{0, 0, kNoBucket});
  slot_shift_ = shift;
  const std::size_t mask = slots - 1;
  for (std::uint32_t r = 0; r < order_.size(); ++r) {
    Bucket& b = buckets_[order_[r].bucket];
    b.rank = r;
    b.rank_epoch = epoch_;
    if (!b.entries.empty()) set_filled(r, true);
    std::size_t i = home(b.stream, b.size);
    while (slots_[i].bucket != kNoBucket) i = (i + 1) & mask;
    slots_[i] = order_[r];
  }
}

std::uint32_t CachingAllocator::FreeIndex::add_bucket(int stream, std::uint64_t size) {
  if (order_.size() >= kEmptyBucketsKept && filled_count_ * 4 < order_.size()) rebuild(true);
  std::uint32_t bucket;
  if (!spare_.empty()) {
    bucket = spare_.back();
    spare_.pop_back();
  } else {
    bucket = static_cast<std::uint32_t>(buckets_.size());
    buckets_.emplace_back();
  }
  Bucket& b = buckets_[bucket];
  b.size = size;
  b.stream = stream;
  const std::size_t rank = rank_at_least(stream, size);
  order_.insert(order_.begin() + static_cast<std::ptrdiff_t>(rank), Slot{size, stream, bucket});
  if ((order_.size() + 63) / 64 > filled_.size()) filled_.push_back(0);
  // Shift the bits at and above rank up by one.
  const std::size_t w0 = rank / 64;
  for (std::size_t w = filled_.size() - 1; w > w0; --w) {
    filled_[w] = filled_[w] << 1 | filled_[w - 1] >> 63;
  }
  const std::uint64_t low = (1ull << (rank % 64)) - 1;
  filled_[w0] = (filled_[w0] & low) | ((filled_[w0] & ~low) << 1);
  ++epoch_;
  b.rank = static_cast<std::uint32_t>(rank);
  b.rank_epoch = epoch_;
  if (order_.size() * 4 > slots_.size()) {
    rebuild(false);
  } else {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = home(stream, size);
    while (slots_[i].bucket != kNoBucket) i = (i + 1) & mask;
    slots_[i] = Slot{size, stream, bucket};
  }
  return bucket;
}

namespace {
template <typename V>
auto address_position(V& v, std::uint64_t address) {
  // A freed block often has the lowest address of its size (the backward frees layers from the
  // last one down), so it goes last: checked before searching.
  if (v.empty() || v.back().address > address) return v.end();
  return std::lower_bound(v.begin(), v.end(), address,
                          [](const auto& e, std::uint64_t a) { return e.address > a; });
}
}  // namespace

bool CachingAllocator::FreeIndex::insert(int stream, std::uint64_t size, std::uint64_t address, BlockId id) {
  std::uint32_t bucket = find(stream, size);
  if (bucket == kNoBucket) bucket = add_bucket(stream, size);
  Bucket& b = buckets_[bucket];
  std::vector<Entry>& v = b.entries;
  if (v.empty()) {
    set_filled(rank_of(bucket), true);
    v.push_back(Entry{address, id});
    return true;
  }
  const auto pos = address_position(v, address);
  if (pos != v.end() && pos->address == address) return false;
  v.insert(pos, Entry{address, id});
  return true;
}

void CachingAllocator::FreeIndex::erase(int stream, std::uint64_t size, std::uint64_t address) noexcept {
  const std::uint32_t bucket = find(stream, size);
  Bucket& b = buckets_[bucket];
  b.entries.erase(address_position(b.entries, address));
  if (b.entries.empty()) set_filled(rank_of(bucket), false);
}

void CachingAllocator::FreeIndex::erase(Cursor c) noexcept {
  Bucket& b = buckets_[c.bucket];
  b.entries.erase(b.entries.begin() + static_cast<std::ptrdiff_t>(c.pos));
  if (b.entries.empty()) set_filled(rank_of(c.bucket), false);
}

bool CachingAllocator::FreeIndex::first_at_least(int stream, std::uint64_t size, Cursor& c,
                                                 Hint hint) const noexcept {
  const std::uint32_t own = hint == kNoHint ? find(stream, size) : hint;
  std::size_t rank;
  if (own != kNoBucket) {
    const Bucket& b = buckets_[own];
    if (!b.entries.empty()) {
      c = Cursor{own, b.entries.size() - 1};
      return true;
    }
    rank = next_filled(rank_of(own) + 1);
  } else {
    rank = next_filled(rank_at_least(stream, size));
  }
  if (rank == order_.size()) return false;
  const Slot& k = order_[rank];
  if (k.stream != stream) return false;
  c = Cursor{k.bucket, buckets_[k.bucket].entries.size() - 1};
  return true;
}

bool CachingAllocator::FreeIndex::next(Cursor& c) const noexcept {
  if (c.pos > 0) {
    --c.pos;
    return true;
  }
  const std::size_t rank = next_filled(rank_of(c.bucket) + 1);
  if (rank == order_.size()) return false;
  c = Cursor{order_[rank].bucket, buckets_[order_[rank].bucket].entries.size() - 1};
  return true;
}

void CachingAllocator::FreeIndex::clear() noexcept {
  for (const Slot& k : order_) {
    buckets_[k.bucket].entries.clear();
    spare_.push_back(k.bucket);
  }
  filled_count_ = 0;
  order_.clear();
  filled_.clear();
  for (Slot& k : slots_) k.bucket = kNoBucket;
}

void CachingAllocator::insert_free(BlockId id) {
  const Block& b = blocks_[id];
  if (!free_[b.pool].insert(b.stream, b.size, b.address, id)) bug("a free block was cached twice");
}

void CachingAllocator::erase_free(BlockId id) noexcept {
  const Block& b = blocks_[id];
  free_[b.pool].erase(b.stream, b.size, b.address);
}

void CachingAllocator::insert_unmapped(BlockId id) {
  Block& b = blocks_[id];
  const auto [pos, inserted] = unmapped_[b.pool].insert(AddressKey{b.stream, b.address, id});
  if (!inserted) bug("an unmapped range was recorded twice");
  b.unmapped_pos = pos;
}

void CachingAllocator::erase_unmapped(BlockId id) noexcept {
  const Block& b = blocks_[id];
  unmapped_[b.pool].erase(b.unmapped_pos);
}

// ---- allocate ----

CachingAllocator::BlockId CachingAllocator::allocate(std::uint64_t requested_bytes, int stream) {
  // round_size's common case inline: no power-of-two divisions, no minimum, no overflow.
  const std::uint64_t size = config_.roundup_power2_divisions <= 1 && requested_bytes >= kMinBlockBytes &&
                                     requested_bytes <= kMaxBytes - (kMinBlockBytes - 1)
                                 ? (requested_bytes + (kMinBlockBytes - 1)) & ~(kMinBlockBytes - 1)
                                 : round_size(requested_bytes, config_);
  const Pool pool = size <= kSmallRequestMaxBytes ? kSmallPool : kLargePool;

  // Nothing below changes the allocator before the last point that can throw
  // overflow_error (new_segment / grow_expandable claim address space first).
  // A block of exactly the rounded size is the best fit and passes the max_split_size vetoes
  // (no slack); with expandable segments the walk in take_free_block may still prefer another.
  FreeIndex::Hint hint = FreeIndex::kNoHint;
  BlockId id = config_.expandable_segments ? kNoBlock : free_[pool].take_exact(stream, size, hint);
  if (id == kNoBlock) id = take_free_block(pool, stream, size, hint);
  if (id == kNoBlock) {
    id = config_.expandable_segments ? grow_expandable(pool, stream, size)
                                     : new_segment(pool, stream, allocation_size(size));
  }

  const std::uint64_t remaining = blocks_[id].size - size;
  if (should_split(pool, size, remaining)) split_tail(id, size);

  Block& b = blocks_[id];
  b.allocated = true;
  allocated_bytes_ += b.size;  // the block's size, not the request: Note [Caching allocator replay]
  peak_allocated_bytes_ = std::max(peak_allocated_bytes_, allocated_bytes_);
  return id;
}

// get_free_block: best fit on the stream, then the max_split_size vetoes on that
// one candidate (a veto is a miss; no other block is tried).
CachingAllocator::BlockId CachingAllocator::take_free_block(Pool pool, int stream, std::uint64_t size,
                                                            FreeIndex::Hint hint) {
  FreeIndex& set = free_[pool];
  FreeIndex::Cursor it;
  if (!set.first_at_least(stream, size, it, hint)) return kNoBlock;

  if (config_.expandable_segments) {
    // A block that borders unmapped space "fits" as far as it could grow; walk
    // on while the next block is smaller by that measure, so a block that fits
    // as it stands beats growing the arena.
    FreeIndex::Cursor next = it;
    while (set.next(next) && set.stream(next) == stream &&
           expandable_size(set.id(next)) < expandable_size(set.id(it))) {
      it = next;
    }
  }

  const std::uint64_t max_split = config_.max_split_size_bytes;
  const std::uint64_t found = set.size(it);
  // A request below max_split_size never takes an oversize block ...
  if (size < max_split && found >= max_split) return kNoBlock;
  // ... and an oversize request takes one only when the slack is small.
  if (size >= max_split && found - size >= config_.max_non_split_rounding_bytes) {
    return kNoBlock;
  }
  const BlockId id = set.id(it);
  set.erase(it);
  return id;
}

std::uint64_t CachingAllocator::expandable_size(BlockId id) const noexcept {
  const Block& b = blocks_[id];
  if (b.next != kNoBlock && !blocks_[b.next].mapped) return b.size + blocks_[b.next].size;
  return b.size;
}

// The block keeps its first keep_bytes; the rest becomes a block of its own right after it in
// the segment, mapped or not as told, and in no index yet.
CachingAllocator::BlockId CachingAllocator::split_after(BlockId id, std::uint64_t keep_bytes, bool mapped) {
  const BlockId rest = new_block();  // may move blocks_: take references after
  Block& b = blocks_[id];
  Block& r = blocks_[rest];
  r.address = b.address + keep_bytes;
  r.size = b.size - keep_bytes;
  r.stream = b.stream;
  r.pool = b.pool;
  r.mapped = mapped;
  r.prev = id;
  r.next = b.next;
  if (b.next != kNoBlock) blocks_[b.next].prev = rest;
  b.next = rest;
  b.size = keep_bytes;
  return rest;
}

// The block keeps its first keep_bytes; the rest becomes a cached free block.
void CachingAllocator::split_tail(BlockId id, std::uint64_t keep_bytes) { insert_free(split_after(id, keep_bytes, true)); }

namespace {

[[noreturn]] void throw_no_address_space(std::uint64_t block_bytes) {
  throw std::overflow_error("cannot place a block of " + std::to_string(block_bytes) +
                            " bytes: the allocator model's address space ends at 2^63 bytes");
}

}  // namespace

// Start of a free range of `bytes` at the end of the model address space, aligned
// to `align`; throws (naming the block that needed it) when it does not fit.
std::uint64_t CachingAllocator::claim_address_range(std::uint64_t align, std::uint64_t bytes,
                                                    std::uint64_t block_bytes) const {
  std::uint64_t base = 0;
  if (!round_up_any(next_address_, align, base) || base > kAddressSpaceBytes ||
      bytes > kAddressSpaceBytes - base) {
    throw_no_address_space(block_bytes);
  }
  return base;
}

// The one place where reserved memory grows (cudaMalloc or cuMemMap). A device
// capacity belongs here: on failure PyTorch runs its free-memory callbacks, frees
// oversize cached blocks (only with max_split_size set; never expandable ones),
// then every wholly free segment (release_cached_blocks; with expandable segments
// every free page), retries, and only then raises OutOfMemoryError
// (docs/planner.md, "What fits means").
void CachingAllocator::reserve_device_bytes(std::uint64_t bytes) noexcept {
  reserved_bytes_ += bytes;
  peak_reserved_bytes_ = std::max(peak_reserved_bytes_, reserved_bytes_);
}

// alloc_block without expandable segments: one cudaMalloc'd segment.
CachingAllocator::BlockId CachingAllocator::new_segment(Pool pool, int stream,
                                                        std::uint64_t segment_bytes) {
  const std::uint64_t base = claim_address_range(1, segment_bytes, segment_bytes);
  const BlockId id = new_block();
  Block& b = blocks_[id];
  b.address = base;
  b.size = segment_bytes;
  b.stream = stream;
  b.pool = pool;
  next_address_ = base + segment_bytes;
  reserve_device_bytes(segment_bytes);
  ++segment_count_;
  return id;
}

// ---- expandable segments (try_allocate_expandable_block) ----

CachingAllocator::BlockId CachingAllocator::grow_expandable(Pool pool, int stream,
                                                            std::uint64_t size) {
  BlockId candidate = find_expandable_start(pool, stream, size);
  if (!blocks_[candidate].mapped) {
    candidate = map_pages(candidate, std::min(blocks_[candidate].size, size));
  }
  // candidate is now a free mapped block followed by unmapped space; map pages
  // behind it until it is big enough (each map merges into the candidate).
  while (blocks_[candidate].size < size) {
    const BlockId next = blocks_[candidate].next;
    if (next == kNoBlock || blocks_[next].mapped || blocks_[next].allocated) {
      bug("an expandable arena has no unmapped space where room was found");
    }
    const std::uint64_t missing = size - blocks_[candidate].size;
    candidate = map_pages(next, std::min(missing, blocks_[next].size));
  }
  erase_free(candidate);
  return candidate;
}

// find_expandable_block: the lowest-address unmapped range on this stream that,
// together with the free block just below it and whatever free or unmapped space
// follows, holds `size`; a new arena when none does.
CachingAllocator::BlockId CachingAllocator::find_expandable_start(Pool pool, int stream,
                                                                  std::uint64_t size) {
  UnmappedSet& set = unmapped_[pool];
  for (auto it = set.lower_bound(AddressKey{stream, 0, 0});
       it != set.end() && it->stream == stream; ++it) {
    BlockId start = it->id;
    const BlockId prev = blocks_[start].prev;
    if (prev != kNoBlock && !blocks_[prev].allocated) start = prev;
    if (has_room_from(start, size)) return start;
  }

  const std::uint64_t page = page_bytes(pool);
  std::uint64_t needed = 0;
  if (!round_up_any(size, page, needed)) throw_no_address_space(size);
  const std::uint64_t arena_bytes = std::max(kExpandableArenaPages * page, needed);
  const std::uint64_t base = claim_address_range(page, arena_bytes, size);
  const BlockId id = new_block();
  Block& b = blocks_[id];
  b.address = base;
  b.size = arena_bytes;
  b.stream = stream;
  b.pool = pool;
  b.mapped = false;
  next_address_ = base + arena_bytes;
  insert_unmapped(id);
  ++segment_count_;
  return id;
}

bool CachingAllocator::has_room_from(BlockId id, std::uint64_t size) const noexcept {
  std::uint64_t bytes = 0;
  while (bytes < size && id != kNoBlock && !blocks_[id].allocated) {
    bytes += blocks_[id].size;
    id = blocks_[id].next;
  }
  return bytes >= size;
}

// map_block: maps whole pages at the start of an unmapped range, merges the new
// memory with free mapped neighbours and caches it. Returns the merged block.
CachingAllocator::BlockId CachingAllocator::map_pages(BlockId unmapped, std::uint64_t bytes) {
  const Pool pool = blocks_[unmapped].pool;
  std::uint64_t mapped = 0;
  // Cannot overflow: the range is page-aligned and whole pages long, so the
  // rounded size is at most the range's size.
  round_up_any(bytes, page_bytes(pool), mapped);
  if (mapped > blocks_[unmapped].size) bug("mapping ran past an unmapped range");

  erase_unmapped(unmapped);
  if (mapped < blocks_[unmapped].size) insert_unmapped(split_after(unmapped, mapped, false));
  blocks_[unmapped].mapped = true;
  try_merge(unmapped, blocks_[unmapped].prev);
  try_merge(unmapped, blocks_[unmapped].next);
  insert_free(unmapped);
  reserve_device_bytes(mapped);
  return unmapped;
}

// ---- release ----

void CachingAllocator::release(BlockId block) {
  if (!is_live_allocation(block)) {
    throw std::invalid_argument("release: block " + std::to_string(block) +
                                " is not a live allocation (already released, or never "
                                "returned by allocate)");
  }
  Block& b = blocks_[block];
  b.allocated = false;
  allocated_bytes_ -= b.size;
  // free_block: absorb free neighbours of the same segment, then cache. (Most blocks have no free
  // neighbour: that is told here, without the call.)
  const BlockId prev = b.prev;
  if (prev != kNoBlock && !blocks_[prev].allocated) try_merge(block, prev);
  const BlockId next = blocks_[block].next;
  if (next != kNoBlock && !blocks_[next].allocated) try_merge(block, next);
  insert_free(block);
}

std::uint64_t CachingAllocator::block_bytes(BlockId block) const {
  if (!is_live_allocation(block)) {
    throw std::invalid_argument("block_bytes: block " + std::to_string(block) +
                                " is not a live allocation (already released, or never "
                                "returned by allocate)");
  }
  return blocks_[block].size;
}

// try_merge_blocks: dst absorbs src when src is a free neighbour in the same
// mapping state. dst must not be in a free or unmapped set (its key changes).
void CachingAllocator::try_merge(BlockId dst, BlockId src) noexcept {
  if (src == kNoBlock) return;
  Block& s = blocks_[src];
  Block& d = blocks_[dst];
  if (s.allocated || s.mapped != d.mapped) return;
  if (s.mapped) {
    erase_free(src);
  } else {
    erase_unmapped(src);
  }
  if (d.prev == src) {
    d.address = s.address;
    d.prev = s.prev;
    if (d.prev != kNoBlock) blocks_[d.prev].next = dst;
  } else {
    d.next = s.next;
    if (d.next != kNoBlock) blocks_[d.next].prev = dst;
  }
  d.size += s.size;
  recycle(src);
}

// ---- empty_cache (release_cached_blocks / release_blocks) ----

void CachingAllocator::empty_cache() {
  for (const Pool pool : {kLargePool, kSmallPool}) {
    scratch_.clear();
    free_[pool].for_each([&](BlockId id) {
      const Block& b = blocks_[id];
      if (config_.expandable_segments || (b.prev == kNoBlock && b.next == kNoBlock)) {
        scratch_.push_back(id);
      }
    });
    for (const BlockId id : scratch_) {
      if (!config_.expandable_segments) {
        // A whole free segment: cudaFree.
        erase_free(id);
        reserved_bytes_ -= blocks_[id].size;
        --segment_count_;
        recycle(id);
        continue;
      }
      unmap_free_pages(id);
      const Block& b = blocks_[id];
      if (!b.mapped && b.prev == kNoBlock && b.next == kNoBlock) {
        // Nothing of the arena is mapped any more: drop it.
        erase_unmapped(id);
        --segment_count_;
        recycle(id);
      }
    }
  }
  scratch_.clear();
}

// unmap_block: gives back the whole pages inside a free block; the partial pages
// at either end stay mapped as free blocks of their own.
void CachingAllocator::unmap_free_pages(BlockId id) {
  const std::uint64_t page = page_bytes(blocks_[id].pool);
  const std::uint64_t start = blocks_[id].address;
  const std::uint64_t end = start + blocks_[id].size;
  std::uint64_t first = 0;
  round_up_any(start, page, first);  // addresses stay below 2^63: no overflow
  const std::uint64_t last = end - end % page;
  if (first >= last) return;

  erase_free(id);
  if (first > start) {
    const BlockId before = new_block();
    Block& f = blocks_[before];
    Block& b = blocks_[id];
    f.address = start;
    f.size = first - start;
    f.stream = b.stream;
    f.pool = b.pool;
    f.prev = b.prev;
    f.next = id;
    if (b.prev != kNoBlock) blocks_[b.prev].next = before;
    b.prev = before;
    insert_free(before);
  }
  if (last < end) insert_free(split_after(id, last - start, true));  // the block still starts at `start`
  Block& b = blocks_[id];
  b.address = first;
  b.size = last - first;
  b.mapped = false;
  reserved_bytes_ -= last - first;
  try_merge(id, blocks_[id].prev);
  try_merge(id, blocks_[id].next);
  insert_unmapped(id);
}

// ---- stats and reuse ----

void CachingAllocator::reset_peak_stats() noexcept {
  peak_allocated_bytes_ = allocated_bytes_;
  peak_reserved_bytes_ = reserved_bytes_;
}

void CachingAllocator::reset() {
  for (FreeIndex& set : free_) set.clear();
  for (UnmappedSet& set : unmapped_) set.clear();
  blocks_.clear();
  reusable_ids_.clear();
  scratch_.clear();
  next_address_ = 0;
  allocated_bytes_ = 0;
  reserved_bytes_ = 0;
  peak_allocated_bytes_ = 0;
  peak_reserved_bytes_ = 0;
  segment_count_ = 0;
}

void CachingAllocator::layout(std::vector<RangeView>& out) const {
  out.clear();
  for (BlockId id = 0; id < blocks_.size(); ++id) {
    const Block& b = blocks_[id];
    if (!b.live) continue;
    out.push_back({id, b.address, b.size, b.allocated, b.mapped, b.stream, b.prev == kNoBlock, b.pool == kSmallPool});
  }
  std::sort(out.begin(), out.end(), [](const RangeView& a, const RangeView& b) { return a.address < b.address; });
}

}  // namespace trainmem::sim
