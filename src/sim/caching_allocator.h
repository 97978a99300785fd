// Model of PyTorch's CUDA caching allocator, replayed over a trace of
// allocate/release events to predict torch.cuda.max_memory_allocated() and
// torch.cuda.max_memory_reserved() without a GPU.

// Note [Caching allocator replay]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Source: pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator)
// and c10/core/AllocatorConfig.cpp (the PYTORCH_CUDA_ALLOC_CONF parser). The rules
// are summarised in ../shared/design/MEMORY_MECHANICS.md §1 (beside the repository;
// docs/mechanics_notes.md keeps this project's corrections to it).
//
// Replayed the way PyTorch does it:
//   * request rounding (round_size): 512 B multiples, minimum 512 B, and the
//     optional roundup_power2_divisions rule with its "size > 512 × divisions" guard;
//   * two pools, small (rounded size <= 1 MiB) and large, each a set of cached free
//     blocks ordered by (stream, size, address); a block is only reused on the
//     stream it was allocated on;
//   * best fit (get_free_block): the smallest cached block >= the request; only
//     that one candidate is looked at, so the max_split_size rules can turn a
//     fitting block into a miss;
//   * segment size on a miss (get_allocation_size): 2 MiB for the small pool,
//     20 MiB for large requests under 10 MiB, otherwise the request rounded up
//     to 2 MiB;
//   * splitting (should_split): small pool or expandable segments when the
//     remainder is >= 512 B; large pool when the request is < max_split_size and
//     the remainder is > 1 MiB. An unsplit block is charged whole;
//   * merging on free with free neighbours of the same segment
//     (try_merge_blocks); separate segments never merge;
//   * statistics: allocated_bytes moves by the block's size (after rounding and
//     the split decision), reserved_bytes by whole segments or mapped pages;
//     peaks are high-water marks of both (DeviceStats);
//   * empty_cache (release_cached_blocks): frees segments that are one whole free
//     block; with expandable segments it unmaps every fully free page and drops
//     an arena once nothing in it is mapped;
//   * expandable segments (try_allocate_expandable_block, map_block,
//     unmap_block): one virtual arena per (stream, pool), mapped in 2 MiB pages
//     (small pool) or 20 MiB pages (large pool), grown at the lowest address
//     that has room, including the free block just below an unmapped range;
//     best fit prefers a block that fits without growing into unmapped space.
//
// Not replayed:
//   * device capacity: nothing ever fails, so the out-of-memory path (free
//     oversize cached blocks, then all unsplit cached blocks, then raise), the
//     garbage_collection_threshold and set_per_process_memory_fraction are not
//     modelled. CachingAllocator::reserve_device_bytes() is the one place where
//     reserved memory grows; a capacity check belongs there.
//   * cross-stream lifetimes (recordStream events): a release frees at once.
//   * CUDA graph private pools, IPC, peer access, per-interval divisions (one
//     value is used for every size interval), requested_bytes and the other
//     counters of torch.cuda.memory_stats().
//   * real addresses. Segments are laid out one after another in a model address
//     space capped at 2^63 bytes; addresses only order equal-size free blocks
//     and decide adjacency, so tie-breaks between equal blocks in different
//     segments can differ from a real run.
//   * Expandable arenas have a fixed virtual size (kExpandableArenaPages pages, or
//     more for a larger request) instead of 1.125 × device memory.
//   * segment_count() counts cudaMalloc'd segments plus live expandable arenas;
//     PyTorch's "segment" statistic does not count arenas at all.

#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <set>
#include <vector>

namespace trainmem::sim {

// Allocator settings, in bytes; the PYTORCH_CUDA_ALLOC_CONF key is named per field.
struct AllocatorConfig {
  // expandable_segments: every block is split when the remainder is >= 512 B, and
  // reserved memory grows by 20 MiB (large pool) or 2 MiB (small pool) pages.
  bool expandable_segments = false;
  // max_split_size_mb × 1 MiB. UINT64_MAX = unlimited (PyTorch's default);
  // otherwise it must be >= 20 MiB, as PyTorch's parser requires.
  std::uint64_t max_split_size_bytes = UINT64_MAX;
  // max_non_split_rounding_mb × 1 MiB (>= 20 MiB): how much larger than the request
  // a cached oversize block may be and still be handed out whole.
  std::uint64_t max_non_split_rounding_bytes = 20ull << 20;
  // roundup_power2_divisions: 0 or 1 = off, otherwise a power of two. One value
  // for all size intervals.
  unsigned roundup_power2_divisions = 0;
};

// Replays one device's caching allocator. Single-threaded; best fit is a hash
// lookup of the request's size, or the next size in order that holds cached blocks
// (FreeIndex), and a warmed-up replay allocates almost nothing. Not copyable or
// movable (the unmapped-range sets draw their nodes from a pool owned by the
// object); reset() reuses it.
class CachingAllocator {  // hidden symbols: See Note [Engine symbols are hidden] in CMakeLists.txt
 public:
  using BlockId = std::uint32_t;

  // Constants of the PyTorch allocator, named with their units.
  static constexpr std::uint64_t kMinBlockBytes = 512;                 // kMinBlockSize
  static constexpr std::uint64_t kSmallRequestMaxBytes = 1ull << 20;   // kSmallSize, 1 MiB
  static constexpr std::uint64_t kSmallSegmentBytes = 2ull << 20;      // kSmallBuffer, 2 MiB
  static constexpr std::uint64_t kMinLargeAllocBytes = 10ull << 20;    // kMinLargeAlloc, 10 MiB
  static constexpr std::uint64_t kLargeSegmentBytes = 20ull << 20;     // kLargeBuffer, 20 MiB
  static constexpr std::uint64_t kLargeRoundBytes = 2ull << 20;        // kRoundLarge, 2 MiB
  static constexpr std::uint64_t kSmallPageBytes = 2ull << 20;   // expandable page, small pool
  static constexpr std::uint64_t kLargePageBytes = 20ull << 20;  // expandable page, large pool
  // Virtual size of an expandable arena, in pages (1.25 TiB large, 128 GiB small).
  static constexpr std::uint64_t kExpandableArenaPages = 1ull << 16;
  // End of the model address space (2^63 B); a request that cannot fit in it throws.
  static constexpr std::uint64_t kAddressSpaceBytes = 1ull << 63;

  // Throws std::invalid_argument for a setting PyTorch would reject.
  explicit CachingAllocator(AllocatorConfig config = {});

  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  CachingAllocator(CachingAllocator&&) = delete;
  CachingAllocator& operator=(CachingAllocator&&) = delete;
  ~CachingAllocator();

  // Allocates requested_bytes on `stream` (any int names a stream) and returns a
  // handle, valid until release(). Throws std::overflow_error when the request
  // cannot be rounded or placed in 64-bit byte arithmetic; the allocator is then
  // unchanged.
  BlockId allocate(std::uint64_t requested_bytes, int stream = 0);
  // Frees the block. Throws std::invalid_argument for a handle that is not a live
  // allocation (a stale handle is only caught while its id has not been reused).
  void release(BlockId block);
  // Bytes charged to allocated_bytes for this live block (its rounded, possibly
  // unsplit size). Throws std::invalid_argument like release().
  std::uint64_t block_bytes(BlockId block) const;

  // torch.cuda.memory_allocated() / memory_reserved() and their peaks
  // (max_memory_allocated() / max_memory_reserved()).
  std::uint64_t allocated_bytes() const noexcept { return allocated_bytes_; }
  std::uint64_t reserved_bytes() const noexcept { return reserved_bytes_; }
  std::uint64_t peak_allocated_bytes() const noexcept { return peak_allocated_bytes_; }
  std::uint64_t peak_reserved_bytes() const noexcept { return peak_reserved_bytes_; }
  // cudaMalloc'd segments plus live expandable arenas (see the Note).
  std::uint64_t segment_count() const noexcept { return segment_count_; }

  // One range of device memory as the allocator holds it, for comparing two allocator states.
  struct RangeView {
    BlockId id;
    std::uint64_t address;
    std::uint64_t size;
    bool allocated;
    bool mapped;
    int stream;
    bool segment_start;  // the first range of its segment (or expandable arena)
    bool small_pool;     // the pool of its segment: small (requests up to 1 MiB) or large
  };
  // Every range of every segment, by address, and the next free device address: together they
  // decide everything the allocator will do next (block ids do not).
  void layout(std::vector<RangeView>& out) const;
  std::uint64_t next_address() const noexcept { return next_address_; }

  // torch.cuda.empty_cache(): returns every wholly free segment (with expandable
  // segments: every fully free page) to the device.
  void empty_cache();
  // torch.cuda.reset_peak_memory_stats(): peaks drop to the current values.
  void reset_peak_stats() noexcept;
  // Back to the freshly constructed state with the same config, keeping storage.
  void reset();
  // reset() with another config (a pooled allocator serving the next replay); validated as the
  // constructor validates it.
  void reset(AllocatorConfig config);
  // Throws std::invalid_argument for a config PyTorch would not accept (see the constructor).
  static void validate(const AllocatorConfig& config);

  const AllocatorConfig& config() const noexcept { return config_; }

  // The block size a request is rounded to (round_size). Throws
  // std::overflow_error if rounding would pass 2^64 - 1, std::invalid_argument for
  // a roundup_power2_divisions that is not 0 or a power of two.
  static std::uint64_t round_size(std::uint64_t bytes, const AllocatorConfig& config);
  // The step of roundup_power2_divisions: `bytes` rounded up to the next of
  // `divisions` equal steps between the powers of two around it (1200, 4 -> 1280).
  // round_size only applies it when bytes > 512 × divisions.
  static std::uint64_t round_up_power2_division(std::uint64_t bytes, unsigned divisions);
  // The cudaMalloc segment size for a rounded request (get_allocation_size).
  // Throws std::overflow_error if it would pass 2^64 - 1.
  static std::uint64_t allocation_size(std::uint64_t rounded_bytes);

 private:
  static constexpr BlockId kNoBlock = UINT32_MAX;
  enum Pool : std::uint8_t { kSmallPool = 0, kLargePool = 1 };

  struct AddressKey {  // unmapped ranges of expandable arenas
    int stream;
    std::uint64_t address;
    BlockId id;
  };
  struct AddressOrder {
    bool operator()(const AddressKey& a, const AddressKey& b) const noexcept {
      if (a.stream != b.stream) return a.stream < b.stream;
      return a.address < b.address;
    }
  };

  // Recycles the fixed-size nodes of the two kinds of set: a set only ever
  // allocates one node at a time, so a free list beats a general allocator.
  class NodePool {
   public:
    static constexpr std::size_t kSlotBytes = 64;
    NodePool() = default;
    NodePool(const NodePool&) = delete;
    NodePool& operator=(const NodePool&) = delete;
    void* take();
    void give(void* slot) noexcept;

   private:
    union Slot {
      Slot* next;
      alignas(std::max_align_t) unsigned char bytes[kSlotBytes];
    };
    static constexpr std::size_t kChunkSlots = 1024;
    std::vector<std::unique_ptr<Slot[]>> chunks_;
    std::size_t used_in_last_chunk_ = kChunkSlots;
    Slot* free_ = nullptr;
  };
  template <typename T>
  struct NodeAllocator {
    using value_type = T;
    NodePool* pool;
    explicit NodeAllocator(NodePool* p) noexcept : pool(p) {}
    template <typename U>
    NodeAllocator(const NodeAllocator<U>& other) noexcept : pool(other.pool) {}
    T* allocate(std::size_t n) {
      static_assert(sizeof(T) <= NodePool::kSlotBytes && alignof(T) <= alignof(std::max_align_t));
      if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
      return static_cast<T*>(pool->take());
    }
    void deallocate(T* p, std::size_t n) noexcept {
      if (n != 1) {
        ::operator delete(p);
      } else {
        pool->give(p);
      }
    }
    template <typename U>
    bool operator==(const NodeAllocator<U>& other) const noexcept {
      return pool == other.pool;
    }
  };
  // Cached free blocks of one pool in best-fit order: (stream, size, address). A replay holds
  // hundreds of free blocks but only a few hundred distinct sizes over its whole run and about
  // ten at a time (the layers repeat), so blocks are kept in one list per (stream, size), by
  // descending address (the best fit is the last entry). A size keeps its bucket while its list
  // is empty: a hash table finds the bucket of a (stream, size), the buckets sit in (stream, size)
  // order with a bit for each that holds blocks, and best fit is the next set bit from the
  // request's place (Note [Free buckets that stay] in caching_allocator.cpp).
  class FreeIndex {
   public:
    struct Cursor {
      std::uint32_t bucket = 0;  // a bucket (stable until clear())
      std::size_t pos = 0;       // in its entry list
    };
    FreeIndex();
    bool insert(int stream, std::uint64_t size, std::uint64_t address, BlockId id);
    void erase(int stream, std::uint64_t size, std::uint64_t address) noexcept;
    void erase(Cursor c) noexcept;
    // What take_exact found for a (stream, size), so that first_at_least need not look again.
    using Hint = std::uint32_t;
    static constexpr Hint kNoHint = UINT32_MAX - 1;
    // The first block of `stream` with a size of at least `size` (lowest address among equals);
    // `hint` is take_exact's for the same (stream, size) with nothing changed since, if known.
    bool first_at_least(int stream, std::uint64_t size, Cursor& c, Hint hint = kNoHint) const noexcept;
    // Takes the lowest-address block of exactly (stream, size) when there is one (best fit, as
    // no cached size lies between); kNoBlock, and nothing changed, otherwise.
    BlockId take_exact(int stream, std::uint64_t size, Hint& hint) noexcept {
      const std::uint32_t bucket = find(stream, size);
      hint = bucket;
      if (bucket == kNoBucket) return kNoBlock;
      Bucket& b = buckets_[bucket];
      if (b.entries.empty()) return kNoBlock;
      const BlockId id = b.entries.back().id;
      b.entries.pop_back();
      if (b.entries.empty()) set_filled(rank_of(bucket), false);
      return id;
    }
    // The next block in (stream, size, address) order.
    bool next(Cursor& c) const noexcept;
    BlockId id(Cursor c) const noexcept { return buckets_[c.bucket].entries[c.pos].id; }
    std::uint64_t size(Cursor c) const noexcept { return buckets_[c.bucket].size; }
    int stream(Cursor c) const noexcept { return buckets_[c.bucket].stream; }
    // Every block in (stream, size, address) order.
    template <typename F>
    void for_each(F&& f) const {
      for (const Slot& k : order_) {
        const std::vector<Entry>& v = buckets_[k.bucket].entries;
        for (auto e = v.rbegin(); e != v.rend(); ++e) f(e->id);
      }
    }
    void clear() noexcept;

   private:
    static constexpr std::uint32_t kNoBucket = UINT32_MAX;
    // Buckets in order_ before empty ones are given up (Note [Free buckets that stay]).
    static constexpr std::size_t kEmptyBucketsKept = 256;
    struct Entry {
      std::uint64_t address;
      BlockId id;
    };
    struct Bucket {
      std::uint64_t size = 0;
      int stream = 0;
      // Its place in order_, valid while rank_epoch is the index's epoch_ (see rank_of).
      mutable std::uint32_t rank = 0;
      mutable std::uint64_t rank_epoch = 0;
      std::vector<Entry> entries;  // by descending address
    };
    // A (stream, size) and its bucket: order_'s entries, and the hash table's (kNoBucket: empty).
    struct Slot {
      std::uint64_t size;
      int stream;
      std::uint32_t bucket;
    };
    std::size_t home(int stream, std::uint64_t size) const noexcept {
      const std::uint64_t k =
          (size >> 9) ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(stream)) << 40);
      return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> slot_shift_);
    }
    std::uint32_t find(int stream, std::uint64_t size) const noexcept {  // kNoBucket if none
      const std::size_t mask = slots_.size() - 1;
      for (std::size_t i = home(stream, size);; i = (i + 1) & mask) {
        const Slot& k = slots_[i];
        if (k.bucket == kNoBucket) return kNoBucket;
        if (k.size == size && k.stream == stream) return k.bucket;
      }
    }
    void set_filled(std::uint32_t rank, bool filled) noexcept {
      const std::uint64_t bit = 1ull << (rank % 64);
      if (filled) {
        filled_[rank / 64] |= bit;
        ++filled_count_;
      } else {
        filled_[rank / 64] &= ~bit;
        --filled_count_;
      }
    }
    std::size_t rank_at_least(int stream, std::uint64_t size) const noexcept;
    // A bucket's place in order_. Making a bucket moves the places above it; rather than rewrite
    // them all, it starts a new epoch, and a place from an older one is searched again when asked.
    std::uint32_t rank_of(std::uint32_t bucket) const noexcept {
      const Bucket& b = buckets_[bucket];
      if (b.rank_epoch != epoch_) {
        b.rank = static_cast<std::uint32_t>(rank_at_least(b.stream, b.size));
        b.rank_epoch = epoch_;
      }
      return b.rank;
    }
    std::size_t next_filled(std::size_t rank) const noexcept;  // order_.size() if none
    std::uint32_t add_bucket(int stream, std::uint64_t size);
    void rebuild(bool only_filled);
    std::vector<Bucket> buckets_;            // those in order_, and spare ones kept for their lists
    std::vector<std::uint32_t> spare_;       // buckets_ indices not in order_ (no blocks, no key)
    std::uint64_t epoch_ = 1;                // changes whenever places in order_ move
    std::uint32_t filled_count_ = 0;         // buckets holding blocks
    std::vector<Slot> order_;                // every bucket in use, by (stream, size)
    std::vector<std::uint64_t> filled_;      // bit r: order_[r] holds blocks
    std::vector<Slot> slots_;                // open addressing, linear probing, at most 1/4 full
    std::uint32_t slot_shift_ = 0;           // 64 - log2(slots_.size())
  };
  using UnmappedSet = std::set<AddressKey, AddressOrder, NodeAllocator<AddressKey>>;

  // A range of one segment (or arena): handed out, cached free, or (expandable
  // only) unmapped. prev/next link the ranges of the same segment by address.
  struct Block {
    std::uint64_t address = 0;
    std::uint64_t size = 0;
    BlockId prev = kNoBlock;
    BlockId next = kNoBlock;
    int stream = 0;
    Pool pool = kSmallPool;
    bool allocated = false;
    bool mapped = true;
    bool live = false;  // false while the id sits on the reuse list
    // Where the block sits in unmapped_, so leaving the set needs no search.
    // Meaningful only while it is in that set.
    UnmappedSet::iterator unmapped_pos{};
  };

  static std::uint64_t page_bytes(Pool pool) noexcept;
  bool should_split(Pool pool, std::uint64_t size, std::uint64_t remaining) const noexcept;
  std::uint64_t expandable_size(BlockId id) const noexcept;

  BlockId new_block();
  void recycle(BlockId id) noexcept;
  bool is_live_allocation(BlockId id) const noexcept;
  void insert_free(BlockId id);
  void erase_free(BlockId id) noexcept;
  void insert_unmapped(BlockId id);
  void erase_unmapped(BlockId id) noexcept;

  BlockId take_free_block(Pool pool, int stream, std::uint64_t size,
                          FreeIndex::Hint hint = FreeIndex::kNoHint);
  BlockId split_after(BlockId id, std::uint64_t keep_bytes, bool mapped);
  void split_tail(BlockId id, std::uint64_t keep_bytes);
  void try_merge(BlockId dst, BlockId src) noexcept;
  std::uint64_t claim_address_range(std::uint64_t align, std::uint64_t bytes,
                                    std::uint64_t block_bytes) const;
  void reserve_device_bytes(std::uint64_t bytes) noexcept;

  BlockId new_segment(Pool pool, int stream, std::uint64_t segment_bytes);
  BlockId grow_expandable(Pool pool, int stream, std::uint64_t size);
  BlockId find_expandable_start(Pool pool, int stream, std::uint64_t size);
  bool has_room_from(BlockId id, std::uint64_t size) const noexcept;
  BlockId map_pages(BlockId unmapped, std::uint64_t bytes);
  void unmap_free_pages(BlockId id);

  AllocatorConfig config_;
  NodePool node_pool_;  // declared before the sets that draw on it
  std::array<FreeIndex, 2> free_;
  std::array<UnmappedSet, 2> unmapped_;
  std::vector<Block> blocks_;
  std::vector<BlockId> reusable_ids_;
  std::vector<BlockId> scratch_;  // empty_cache work list, kept for its capacity
  std::uint64_t next_address_ = 0;
  std::uint64_t allocated_bytes_ = 0;
  std::uint64_t reserved_bytes_ = 0;
  std::uint64_t peak_allocated_bytes_ = 0;
  std::uint64_t peak_reserved_bytes_ = 0;
  std::uint64_t segment_count_ = 0;
};

}  // namespace trainmem::sim
