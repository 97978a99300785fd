// Tests for src/sim/caching_allocator.h. Every expected number follows from the
// rules in Note [Caching allocator replay] (PyTorch's CUDACachingAllocator.cpp);
// none was measured on a GPU.

#include "sim/caching_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <random>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace trainmem::sim {
namespace {

constexpr std::uint64_t KiB = 1ull << 10;
constexpr std::uint64_t MiB = 1ull << 20;
constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

using Id = CachingAllocator::BlockId;

// Runs fn, expects it to throw exactly E, and returns what() ("" if it did not throw).
template <typename E, typename Fn>
std::string thrown_message(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const E& e) {
    EXPECT_EQ(typeid(e), typeid(E));
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

AllocatorConfig expandable() {
  AllocatorConfig config;
  config.expandable_segments = true;
  return config;
}

// ---- rounding ----

TEST(CachingAllocatorRounding, RoundsTo512WithA512Minimum) {
  const AllocatorConfig config;
  EXPECT_EQ(CachingAllocator::round_size(0, config), 512u);
  EXPECT_EQ(CachingAllocator::round_size(1, config), 512u);
  EXPECT_EQ(CachingAllocator::round_size(4, config), 512u);
  EXPECT_EQ(CachingAllocator::round_size(512, config), 512u);
  EXPECT_EQ(CachingAllocator::round_size(513, config), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(1000, config), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(MiB, config), MiB);
  EXPECT_EQ(CachingAllocator::round_size(MiB + 1, config), MiB + 512);
  EXPECT_EQ(CachingAllocator::round_size(kMax - 511, config), kMax - 511);  // 2^64 - 512
}

TEST(CachingAllocatorRounding, AllocationSizeBySizeClass) {
  EXPECT_EQ(CachingAllocator::allocation_size(512), 2 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(MiB), 2 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(MiB + 512), 20 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(10 * MiB), 10 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(10 * MiB + 512), 12 * MiB);
  EXPECT_EQ(CachingAllocator::allocation_size(11 * MiB + 512 * KiB), 12 * MiB);
}

TEST(CachingAllocatorRounding, Power2DivisionStep) {
  // The step itself, as in PyTorch's own example.
  EXPECT_EQ(CachingAllocator::round_up_power2_division(1200, 4), 1280u);
  EXPECT_EQ(CachingAllocator::round_up_power2_division(1024, 4), 1024u);
  EXPECT_EQ(CachingAllocator::round_up_power2_division(1280, 4), 1280u);
  EXPECT_EQ(CachingAllocator::round_up_power2_division(1281, 4), 1536u);
}

TEST(CachingAllocatorRounding, Power2DivisionsInRoundSize) {
  AllocatorConfig config;
  config.roundup_power2_divisions = 4;
  // round_size only uses the division step above 512 × divisions = 2048 B, so
  // the step never drops below 512 B: 1200 B still rounds to a 512 multiple.
  EXPECT_EQ(CachingAllocator::round_size(1200, config), 1536u);
  EXPECT_EQ(CachingAllocator::round_size(2048, config), 2048u);
  EXPECT_EQ(CachingAllocator::round_size(2049, config), 2560u);  // 2048 + 2048/4
  EXPECT_EQ(CachingAllocator::round_size(5000, config), 5120u);  // 4096 + 1024
  EXPECT_EQ(CachingAllocator::round_size(3 * MiB + 1, config), 3 * MiB + 512 * KiB);
  EXPECT_EQ(CachingAllocator::round_size(4 * MiB, config), 4 * MiB);
  EXPECT_EQ(CachingAllocator::round_size(100, config), 512u);

  config.roundup_power2_divisions = 2;
  EXPECT_EQ(CachingAllocator::round_size(1200, config), 1536u);  // 1024 + 1024/2
  EXPECT_EQ(CachingAllocator::round_size(5 * MiB, config), 6 * MiB);

  config.roundup_power2_divisions = 1;  // 1 = off
  EXPECT_EQ(CachingAllocator::round_size(5000, config), 5120u);
  EXPECT_EQ(CachingAllocator::round_size(4097, config), 4608u);

  config.roundup_power2_divisions = 4;
  CachingAllocator allocator(config);
  const Id id = allocator.allocate(5000);
  EXPECT_EQ(allocator.block_bytes(id), 5120u);
  EXPECT_EQ(allocator.allocated_bytes(), 5120u);
}

// ---- small pool ----

TEST(CachingAllocatorSmallPool, FourByteScalarCosts512) {
  CachingAllocator allocator;
  const Id id = allocator.allocate(4);
  EXPECT_EQ(allocator.block_bytes(id), 512u);
  EXPECT_EQ(allocator.allocated_bytes(), 512u);
  EXPECT_EQ(allocator.reserved_bytes(), 2 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);
}

TEST(CachingAllocatorSmallPool, OneTwoMiBSegmentHoldsManySmallBlocks) {
  CachingAllocator allocator;
  for (int i = 0; i < 4096; ++i) allocator.allocate(100);  // 4096 × 512 B = 2 MiB
  EXPECT_EQ(allocator.allocated_bytes(), 2 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 2 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);

  allocator.allocate(1);  // the segment is full
  EXPECT_EQ(allocator.reserved_bytes(), 4 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);
}

TEST(CachingAllocatorSmallPool, OneMiBIsSmallAndOneMiBPlusOneIsLarge) {
  CachingAllocator allocator;
  allocator.allocate(MiB);
  allocator.allocate(MiB);  // fills the rest of the same 2 MiB segment
  EXPECT_EQ(allocator.reserved_bytes(), 2 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);

  const Id large = allocator.allocate(MiB + 1);
  EXPECT_EQ(allocator.block_bytes(large), MiB + 512);
  EXPECT_EQ(allocator.reserved_bytes(), 22 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);
}

// ---- large pool ----

TEST(CachingAllocatorLargePool, OneToTenMiBRequestsShareA20MiBSegment) {
  CachingAllocator allocator;
  allocator.allocate(MiB + 512 * KiB);
  allocator.allocate(4 * MiB);
  allocator.allocate(8 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 13 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);

  allocator.allocate(8 * MiB);  // only 6.5 MiB left: a second 20 MiB segment
  EXPECT_EQ(allocator.allocated_bytes(), 21 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);
}

TEST(CachingAllocatorLargePool, TenMiBAndAboveGetTheirOwnSegment) {
  CachingAllocator allocator;
  allocator.allocate(10 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 10 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 10 * MiB);
}

TEST(CachingAllocatorLargePool, UnsplitRemainderIsChargedWhole) {
  CachingAllocator allocator;
  const Id id = allocator.allocate(11 * MiB + 512 * KiB);  // 12 MiB segment, 0.5 MiB left
  EXPECT_EQ(allocator.block_bytes(id), 12 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
}

TEST(CachingAllocatorLargePool, RemainderOverOneMiBIsSplitOff) {
  CachingAllocator allocator;
  const Id id = allocator.allocate(10 * MiB + 512 * KiB);  // 12 MiB segment, 1.5 MiB left
  EXPECT_EQ(allocator.block_bytes(id), 10 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.allocated_bytes(), 10 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);

  const Id rest = allocator.allocate(MiB + 512 * KiB);  // the split-off remainder
  EXPECT_EQ(allocator.block_bytes(rest), MiB + 512 * KiB);
  EXPECT_EQ(allocator.allocated_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);
}

TEST(CachingAllocatorLargePool, ExactlyOneMiBRemainderIsNotSplit) {
  CachingAllocator allocator;
  const Id id = allocator.allocate(11 * MiB);  // 12 MiB segment, exactly 1 MiB left
  EXPECT_EQ(allocator.block_bytes(id), 12 * MiB);
}

TEST(CachingAllocatorReuse, CachedBlockWithUpToOneMiBSlackIsChargedWhole) {
  CachingAllocator allocator;
  allocator.release(allocator.allocate(12 * MiB));
  EXPECT_EQ(allocator.allocated_bytes(), 0u);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);

  const Id id = allocator.allocate(11 * MiB + 256 * KiB);  // 0.75 MiB slack
  EXPECT_EQ(allocator.block_bytes(id), 12 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
  allocator.release(id);

  const Id split = allocator.allocate(10 * MiB + 768 * KiB);  // 1.25 MiB slack: split
  EXPECT_EQ(allocator.block_bytes(split), 10 * MiB + 768 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
}

TEST(CachingAllocatorReuse, BestFitTakesTheSmallestFittingBlock) {
  CachingAllocator allocator;
  const Id a = allocator.allocate(30 * MiB);
  const Id b = allocator.allocate(14 * MiB);
  const Id c = allocator.allocate(20 * MiB);
  allocator.release(a);
  allocator.release(b);
  allocator.release(c);
  EXPECT_EQ(allocator.reserved_bytes(), 64 * MiB);

  // 13 MiB fits 14, 20 and 30: the 14 MiB block wins, with 1 MiB slack unsplit.
  const Id d = allocator.allocate(13 * MiB);
  EXPECT_EQ(allocator.block_bytes(d), 14 * MiB);
  // 19 MiB now fits 20 and 30: the 20 MiB block, unsplit.
  const Id e = allocator.allocate(19 * MiB);
  EXPECT_EQ(allocator.block_bytes(e), 20 * MiB);
  // 25 MiB: only the 30 MiB block is left; 5 MiB is split off.
  const Id f = allocator.allocate(25 * MiB);
  EXPECT_EQ(allocator.block_bytes(f), 25 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 59 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 64 * MiB);
  EXPECT_EQ(allocator.segment_count(), 3u);
}

// ---- merging ----

TEST(CachingAllocatorMerge, FreedNeighboursMergeBackIntoOneBlock) {
  CachingAllocator allocator;
  const Id a = allocator.allocate(4 * MiB);
  const Id b = allocator.allocate(4 * MiB);
  const Id c = allocator.allocate(4 * MiB);  // one 20 MiB segment, 8 MiB free at the end
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
  allocator.release(a);
  allocator.release(c);  // merges with the 8 MiB tail
  allocator.release(b);  // merges with both sides: one 20 MiB free block

  const Id whole = allocator.allocate(19 * MiB);  // needs the merged block
  EXPECT_EQ(allocator.block_bytes(whole), 20 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);
}

TEST(CachingAllocatorMerge, SegmentsNeverMerge) {
  CachingAllocator allocator;
  allocator.release(allocator.allocate(12 * MiB));
  allocator.release(allocator.allocate(12 * MiB + 1));  // 14 MiB: a second segment
  EXPECT_EQ(allocator.segment_count(), 2u);
  allocator.allocate(24 * MiB);  // 26 MiB free in total, but in two segments
  EXPECT_EQ(allocator.reserved_bytes(), 50 * MiB);
  EXPECT_EQ(allocator.segment_count(), 3u);
}

// ---- streams ----

TEST(CachingAllocatorStreams, BlocksAreOnlyReusedOnTheirStream) {
  CachingAllocator allocator;
  allocator.release(allocator.allocate(4 * MiB, /*stream=*/0));
  allocator.allocate(4 * MiB, /*stream=*/1);
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);

  allocator.allocate(4 * MiB, /*stream=*/0);  // back on stream 0: reuses its segment
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);

  allocator.release(allocator.allocate(512, /*stream=*/0));
  allocator.allocate(512, /*stream=*/7);
  EXPECT_EQ(allocator.reserved_bytes(), 44 * MiB);
  EXPECT_EQ(allocator.segment_count(), 4u);
}

// ---- max_split_size ----

AllocatorConfig max_split_100_mib() {
  AllocatorConfig config;
  config.max_split_size_bytes = 100 * MiB;
  return config;
}

TEST(CachingAllocatorMaxSplitSize, SmallerRequestNeverTakesAnOversizeBlock) {
  CachingAllocator allocator(max_split_100_mib());
  allocator.release(allocator.allocate(150 * MiB));
  const Id id = allocator.allocate(30 * MiB);  // best fit is the 150 MiB block: vetoed
  EXPECT_EQ(allocator.block_bytes(id), 30 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 180 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);
}

TEST(CachingAllocatorMaxSplitSize, OversizeRequestTakesOnlyANearFit) {
  CachingAllocator allocator(max_split_100_mib());
  allocator.release(allocator.allocate(150 * MiB));
  const Id a = allocator.allocate(120 * MiB);  // 30 MiB slack >= 20 MiB: new segment
  EXPECT_EQ(allocator.reserved_bytes(), 270 * MiB);
  allocator.release(a);

  const Id b = allocator.allocate(135 * MiB);  // 15 MiB slack: takes 150 MiB unsplit
  EXPECT_EQ(allocator.block_bytes(b), 150 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 150 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 270 * MiB);

  const Id c = allocator.allocate(119 * MiB);  // 1 MiB slack on the 120 MiB block
  EXPECT_EQ(allocator.block_bytes(c), 120 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 270 * MiB);
}

TEST(CachingAllocatorMaxSplitSize, BlocksBelowTheLimitStillSplit) {
  CachingAllocator allocator(max_split_100_mib());
  allocator.release(allocator.allocate(90 * MiB));
  const Id id = allocator.allocate(50 * MiB);
  EXPECT_EQ(allocator.block_bytes(id), 50 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 90 * MiB);
}

TEST(CachingAllocatorMaxSplitSize, NonSplitRoundingIsConfigurable) {
  AllocatorConfig config = max_split_100_mib();
  config.max_non_split_rounding_bytes = 40 * MiB;
  CachingAllocator allocator(config);
  allocator.release(allocator.allocate(150 * MiB));
  const Id id = allocator.allocate(120 * MiB);  // 30 MiB slack < 40 MiB: taken whole
  EXPECT_EQ(allocator.block_bytes(id), 150 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 150 * MiB);
}

TEST(CachingAllocatorConfigCheck, RejectsSettingsPyTorchRejects) {
  AllocatorConfig config;
  config.max_split_size_bytes = 10 * MiB;
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { CachingAllocator allocator(config); }),
            "max_split_size_bytes=10485760 is below the 20971520-byte (20 MiB) minimum; use at "
            "least 20 MiB, or UINT64_MAX for no limit");

  config = {};
  config.max_non_split_rounding_bytes = MiB;
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { CachingAllocator allocator(config); }),
            "max_non_split_rounding_bytes=1048576 is below the 20971520-byte (20 MiB) minimum; "
            "use at least 20 MiB");

  config = {};
  config.roundup_power2_divisions = 3;
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { CachingAllocator allocator(config); }),
            "roundup_power2_divisions=3 is not a power of two; use 0 (off), 1, 2, 4, 8 or 16");
}

// ---- expandable segments ----

TEST(CachingAllocatorExpandable, AllocatedIsTheSumOfRoundedSizes) {
  CachingAllocator allocator(expandable());
  const Id a = allocator.allocate(11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.block_bytes(a), 11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.allocated_bytes(), 11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);  // one 20 MiB page
  EXPECT_EQ(allocator.segment_count(), 1u);

  // 8.5 MiB is free at the top of the mapped range; one more page makes room.
  const Id b = allocator.allocate(10 * MiB);
  EXPECT_EQ(allocator.block_bytes(b), 10 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 21 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);

  const Id c = allocator.allocate(4);  // the small pool's arena maps a 2 MiB page
  EXPECT_EQ(allocator.block_bytes(c), 512u);
  EXPECT_EQ(allocator.reserved_bytes(), 42 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);

  // Fits the 18.5 MiB still free at the top of the large arena: no new page.
  const Id d = allocator.allocate(11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.block_bytes(d), 11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.allocated_bytes(), 33 * MiB + 512);
  EXPECT_EQ(allocator.reserved_bytes(), 42 * MiB);

  for (const Id id : {a, b, c, d}) allocator.release(id);
  EXPECT_EQ(allocator.allocated_bytes(), 0u);
  EXPECT_EQ(allocator.reserved_bytes(), 42 * MiB);  // pages stay mapped until empty_cache
  allocator.empty_cache();
  EXPECT_EQ(allocator.reserved_bytes(), 0u);
  EXPECT_EQ(allocator.segment_count(), 0u);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 42 * MiB);
}

TEST(CachingAllocatorExpandable, SmallPoolGrowsByTwoMiBPages) {
  CachingAllocator allocator(expandable());
  allocator.allocate(MiB);
  allocator.allocate(MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 2 * MiB);
  allocator.allocate(MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 4 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 3 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);
}

TEST(CachingAllocatorExpandable, EachStreamHasItsOwnArena) {
  CachingAllocator allocator(expandable());
  allocator.release(allocator.allocate(4 * MiB, /*stream=*/0));
  allocator.allocate(4 * MiB, /*stream=*/1);
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 2u);
}

TEST(CachingAllocatorExpandable, EmptyCacheUnmapsOnlyWholeFreePagesAndRefillsHoles) {
  CachingAllocator allocator(expandable());
  const Id a = allocator.allocate(30 * MiB);  // [0, 30) of two pages
  const Id b = allocator.allocate(30 * MiB);  // [30, 60): a third page
  EXPECT_EQ(allocator.reserved_bytes(), 60 * MiB);
  allocator.release(a);
  allocator.empty_cache();  // page [0, 20) is free; [20, 30) shares a page with b
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);

  // 15 MiB does not fit the 10 MiB still mapped below b: the hole at [0, 20) is
  // mapped again (lowest address first) and merges with it.
  const Id c = allocator.allocate(15 * MiB);
  EXPECT_EQ(allocator.block_bytes(c), 15 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 60 * MiB);
  EXPECT_EQ(allocator.allocated_bytes(), 45 * MiB);

  allocator.release(b);
  allocator.release(c);
  allocator.empty_cache();
  EXPECT_EQ(allocator.reserved_bytes(), 0u);
  EXPECT_EQ(allocator.segment_count(), 0u);
}

TEST(CachingAllocatorExpandable, BestFitPrefersABlockThatNeedsNoGrowth) {
  CachingAllocator allocator(expandable());
  const Id x = allocator.allocate(9 * MiB);  // [0, 9)
  allocator.allocate(3 * MiB);               // [9, 12); [12, 20) stays free at the top
  allocator.release(x);                      // free: 9 MiB inside, 8 MiB at the top

  // The 8 MiB top block is the tighter fit, but it borders unmapped space, so
  // PyTorch walks on to the 9 MiB block.
  const Id y = allocator.allocate(7 * MiB);
  EXPECT_EQ(allocator.block_bytes(y), 7 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
  // The top block is still 8 MiB, so 9 MiB has to grow the arena by one page.
  allocator.allocate(9 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
}

// ---- empty_cache ----

TEST(CachingAllocatorEmptyCache, ReleasesOnlyWhollyFreeSegments) {
  CachingAllocator allocator;
  const Id live = allocator.allocate(4 * MiB);                     // 20 MiB segment, in use
  allocator.release(allocator.allocate(17 * MiB + 512 * KiB));     // 18 MiB segment, free
  allocator.release(allocator.allocate(512));                      // 2 MiB segment, free
  EXPECT_EQ(allocator.reserved_bytes(), 40 * MiB);
  EXPECT_EQ(allocator.segment_count(), 3u);

  allocator.empty_cache();
  EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
  EXPECT_EQ(allocator.segment_count(), 1u);
  EXPECT_EQ(allocator.allocated_bytes(), 4 * MiB);

  allocator.release(live);  // merges with its 16 MiB remainder: the segment is free
  allocator.empty_cache();
  EXPECT_EQ(allocator.reserved_bytes(), 0u);
  EXPECT_EQ(allocator.segment_count(), 0u);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 40 * MiB);
}

// ---- peaks ----

TEST(CachingAllocatorPeaks, PeaksAreHighWaterMarksUntilReset) {
  CachingAllocator allocator;
  const Id a = allocator.allocate(12 * MiB);
  const Id b = allocator.allocate(24 * MiB);
  EXPECT_EQ(allocator.peak_allocated_bytes(), 36 * MiB);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 36 * MiB);

  allocator.release(b);
  allocator.empty_cache();
  EXPECT_EQ(allocator.allocated_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.peak_allocated_bytes(), 36 * MiB);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 36 * MiB);

  allocator.reset_peak_stats();
  EXPECT_EQ(allocator.peak_allocated_bytes(), 12 * MiB);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 12 * MiB);

  allocator.allocate(1);
  EXPECT_EQ(allocator.peak_allocated_bytes(), 12 * MiB + 512);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 14 * MiB);
  allocator.release(a);
  EXPECT_EQ(allocator.peak_allocated_bytes(), 12 * MiB + 512);
}

TEST(CachingAllocatorReset, ResetStartsOverWithTheSameConfig) {
  CachingAllocator allocator(max_split_100_mib());
  allocator.allocate(150 * MiB);
  allocator.allocate(1);
  allocator.reset();
  EXPECT_EQ(allocator.allocated_bytes(), 0u);
  EXPECT_EQ(allocator.reserved_bytes(), 0u);
  EXPECT_EQ(allocator.peak_allocated_bytes(), 0u);
  EXPECT_EQ(allocator.peak_reserved_bytes(), 0u);
  EXPECT_EQ(allocator.segment_count(), 0u);
  EXPECT_EQ(allocator.config().max_split_size_bytes, 100 * MiB);

  const Id id = allocator.allocate(11 * MiB + 512 * KiB);
  EXPECT_EQ(allocator.block_bytes(id), 12 * MiB);
  EXPECT_EQ(allocator.reserved_bytes(), 12 * MiB);
}

// ---- errors ----

TEST(CachingAllocatorErrors, RoundingOverflowThrows) {
  const AllocatorConfig config;
  EXPECT_EQ(thrown_message<std::overflow_error>(
                [&] { CachingAllocator::round_size(kMax, config); }),
            "cannot round a request of 18446744073709551615 bytes up to a multiple of 512 "
            "bytes: the result does not fit in 64 bits");
  EXPECT_EQ(CachingAllocator::round_size(kMax - 511, config), kMax - 511);
  EXPECT_EQ(thrown_message<std::overflow_error>(
                [&] { CachingAllocator::round_size(kMax - 510, config); }),
            "cannot round a request of 18446744073709551105 bytes up to a multiple of 512 "
            "bytes: the result does not fit in 64 bits");
  EXPECT_EQ(thrown_message<std::overflow_error>(
                [&] { CachingAllocator::allocation_size(kMax - 511); }),
            "cannot size a segment for a block of 18446744073709551104 bytes: rounding up to a "
            "multiple of 2097152 bytes does not fit in 64 bits");

  AllocatorConfig divisions;
  divisions.roundup_power2_divisions = 2;
  const std::uint64_t top = (1ull << 63) + (1ull << 62) + 1;  // next step is 2^64
  EXPECT_EQ(thrown_message<std::overflow_error>(
                [&] { CachingAllocator::round_size(top, divisions); }),
            "cannot round a request of 13835058055282163713 bytes up to the next 1/2 "
            "power-of-two step: the result does not fit in 64 bits");
}

TEST(CachingAllocatorErrors, OverflowingRequestLeavesTheAllocatorUnchanged) {
  for (const bool expandable_segments : {false, true}) {
    AllocatorConfig config;
    config.expandable_segments = expandable_segments;
    CachingAllocator allocator(config);
    const Id kept = allocator.allocate(4 * MiB);

    EXPECT_EQ(thrown_message<std::overflow_error>([&] { allocator.allocate(kMax); }),
              "cannot round a request of 18446744073709551615 bytes up to a multiple of 512 "
              "bytes: the result does not fit in 64 bits");
    // Rounds fine, but no segment of that size fits the model's address space.
    EXPECT_EQ(thrown_message<std::overflow_error>([&] { allocator.allocate(1ull << 63); }),
              "cannot place a block of 9223372036854775808 bytes: the allocator model's "
              "address space ends at 2^63 bytes");
    EXPECT_EQ(thrown_message<std::overflow_error>([&] { allocator.allocate(kMax - 511); }),
              expandable_segments
                  ? "cannot place a block of 18446744073709551104 bytes: the allocator "
                    "model's address space ends at 2^63 bytes"
                  : "cannot size a segment for a block of 18446744073709551104 bytes: rounding "
                    "up to a multiple of 2097152 bytes does not fit in 64 bits");

    EXPECT_EQ(allocator.allocated_bytes(), 4 * MiB);
    EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
    EXPECT_EQ(allocator.segment_count(), 1u);
    allocator.release(kept);
    const Id again = allocator.allocate(4 * MiB);  // still works
    EXPECT_EQ(allocator.reserved_bytes(), 20 * MiB);
    allocator.release(again);
  }
}

TEST(CachingAllocatorErrors, ReleasingADeadHandleThrows) {
  CachingAllocator allocator;
  const Id id = allocator.allocate(4 * MiB);
  allocator.release(id);
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { allocator.release(id); }),
            "release: block " + std::to_string(id) +
                " is not a live allocation (already released, or never returned by allocate)");
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { allocator.release(12345); }),
            "release: block 12345 is not a live allocation (already released, or never "
            "returned by allocate)");
  EXPECT_EQ(thrown_message<std::invalid_argument>([&] { (void)allocator.block_bytes(12345); }),
            "block_bytes: block 12345 is not a live allocation (already released, or never "
            "returned by allocate)");
}

// ---- a long random trace: bookkeeping stays consistent ----

TEST(CachingAllocatorTrace, RandomTraceKeepsTheBooksBalanced) {
  for (const bool expandable_segments : {false, true}) {
    AllocatorConfig config;
    config.expandable_segments = expandable_segments;
    CachingAllocator allocator(config);
    std::mt19937_64 rng(12345);
    std::vector<Id> live;
    std::uint64_t sum_live = 0;
    std::uint64_t peak = 0;
    for (int step = 0; step < 20000; ++step) {
      const bool do_alloc = live.empty() || rng() % 100 < 55;
      if (do_alloc) {
        const std::uint64_t kind = rng() % 4;
        const std::uint64_t bytes = kind == 0   ? rng() % 4096
                                    : kind == 1 ? rng() % (2 * MiB)
                                    : kind == 2 ? rng() % (12 * MiB)
                                                : rng() % (80 * MiB);
        const Id id = allocator.allocate(bytes, static_cast<int>(rng() % 2));
        const std::uint64_t charged = allocator.block_bytes(id);
        ASSERT_GE(charged, CachingAllocator::round_size(bytes, config));
        if (expandable_segments) {
          ASSERT_EQ(charged, CachingAllocator::round_size(bytes, config));
        }
        live.push_back(id);
        sum_live += charged;
      } else {
        const std::size_t pick = rng() % live.size();
        sum_live -= allocator.block_bytes(live[pick]);
        allocator.release(live[pick]);
        live[pick] = live.back();
        live.pop_back();
      }
      if (step % 5000 == 4999) allocator.empty_cache();
      peak = std::max(peak, sum_live);
      ASSERT_EQ(allocator.allocated_bytes(), sum_live);
      ASSERT_LE(allocator.allocated_bytes(), allocator.reserved_bytes());
    }
    EXPECT_EQ(allocator.peak_allocated_bytes(), peak);
    for (const Id id : live) allocator.release(id);
    EXPECT_EQ(allocator.allocated_bytes(), 0u);
    allocator.empty_cache();
    EXPECT_EQ(allocator.reserved_bytes(), 0u);
    EXPECT_EQ(allocator.segment_count(), 0u);
  }
}


// ---- every decision against a plain model of best fit ----

// The caching allocator without its index: free blocks in one ordered set per pool, keyed
// (stream, size, address) as PyTorch's BlockComparatorSize orders them, every block in an
// address-ordered map. Segments only (no expandable arenas). It uses CachingAllocator's
// sizing helpers (round_size, allocation_size), so what it checks is the index and the
// take/split/merge/release bookkeeping around it: which block best fit picks, in every tie.
class PlainAllocator {
 public:
  explicit PlainAllocator(AllocatorConfig config) : config_(config) {}

  // Returns the address of the block handed out.
  std::uint64_t allocate(std::uint64_t requested_bytes, int stream) {
    const std::uint64_t size = CachingAllocator::round_size(requested_bytes, config_);
    const int pool = size <= CachingAllocator::kSmallRequestMaxBytes ? 0 : 1;
    std::uint64_t address = 0;
    auto it = free_[pool].lower_bound({stream, size, 0});
    const bool fits = it != free_[pool].end() && std::get<0>(*it) == stream;
    const std::uint64_t found = fits ? std::get<1>(*it) : 0;
    const std::uint64_t max_split = config_.max_split_size_bytes;
    const bool vetoed = fits && ((size < max_split && found >= max_split) ||
                                 (size >= max_split && found - size >= config_.max_non_split_rounding_bytes));
    if (fits && !vetoed) {
      address = std::get<2>(*it);
      free_[pool].erase(it);
    } else {
      const std::uint64_t segment = CachingAllocator::allocation_size(size);
      address = next_address_;
      next_address_ += segment;
      blocks_[address] = Block{segment, address, stream, pool, false};
      reserved_bytes_ += segment;
      ++segments_;
    }
    Block& b = blocks_.at(address);
    const std::uint64_t remaining = b.size - size;
    const bool split = pool == 0 ? remaining >= CachingAllocator::kMinBlockBytes
                                 : size < max_split && remaining > CachingAllocator::kSmallRequestMaxBytes;
    if (split) {
      blocks_[address + size] = Block{remaining, b.segment, stream, pool, false};
      free_[pool].insert({stream, remaining, address + size});
      b.size = size;
    }
    b.allocated = true;
    allocated_bytes_ += b.size;
    return address;
  }

  void release(std::uint64_t address) {
    auto it = blocks_.find(address);
    it->second.allocated = false;
    allocated_bytes_ -= it->second.size;
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (!prev->second.allocated && prev->second.segment == it->second.segment) {
        unfree(prev);
        prev->second.size += it->second.size;
        blocks_.erase(it);
        it = prev;
      }
    }
    auto next = std::next(it);
    if (next != blocks_.end() && !next->second.allocated && next->second.segment == it->second.segment) {
      unfree(next);
      it->second.size += next->second.size;
      blocks_.erase(next);
    }
    free_[it->second.pool].insert({it->second.stream, it->second.size, it->first});
  }

  void empty_cache() {
    for (auto it = blocks_.begin(); it != blocks_.end();) {
      const Block& b = it->second;
      if (!b.allocated && b.segment == it->first && is_last_of_segment(it)) {
        unfree(it);
        reserved_bytes_ -= b.size;
        --segments_;
        it = blocks_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // The same ranges CachingAllocator::layout() gives, less the ids.
  void expect_same_layout(const CachingAllocator& real, std::vector<CachingAllocator::RangeView>& ranges) const {
    real.layout(ranges);
    ASSERT_EQ(ranges.size(), blocks_.size());
    auto it = blocks_.begin();
    for (const auto& r : ranges) {
      ASSERT_EQ(r.address, it->first);
      ASSERT_EQ(r.size, it->second.size) << "at address " << r.address;
      ASSERT_EQ(r.allocated, it->second.allocated) << "at address " << r.address;
      ASSERT_EQ(r.stream, it->second.stream);
      ASSERT_EQ(r.segment_start, it->second.segment == it->first);
      ++it;
    }
    ASSERT_EQ(real.allocated_bytes(), allocated_bytes_);
    ASSERT_EQ(real.reserved_bytes(), reserved_bytes_);
    ASSERT_EQ(real.segment_count(), segments_);
    ASSERT_EQ(real.next_address(), next_address_);
  }

 private:
  struct Block {
    std::uint64_t size;
    std::uint64_t segment;  // address of the segment's first block
    int stream;
    int pool;
    bool allocated;
  };
  using Iter = std::map<std::uint64_t, Block>::iterator;
  void unfree(Iter it) { free_[it->second.pool].erase({it->second.stream, it->second.size, it->first}); }
  bool is_last_of_segment(Iter it) const {
    const auto next = std::next(it);
    return next == blocks_.end() || next->second.segment != it->second.segment;
  }

  AllocatorConfig config_;
  std::map<std::uint64_t, Block> blocks_;
  std::set<std::tuple<int, std::uint64_t, std::uint64_t>> free_[2];
  std::uint64_t next_address_ = 0;
  std::uint64_t allocated_bytes_ = 0;
  std::uint64_t reserved_bytes_ = 0;
  std::uint64_t segments_ = 0;
};

// Random traces built to make ties: request sizes drawn from a few dozen values (a layer's
// tensors repeat), so many free blocks share a size, plus random sizes that leave split
// remainders of every size; two streams; frees in random order and in reverse order of
// allocation (as the backward frees activations); empty_cache now and then.
TEST(CachingAllocatorTrace, EveryDecisionMatchesAPlainBestFitModel) {
  std::vector<AllocatorConfig> configs(4);
  configs[1].max_split_size_bytes = 40 * MiB;
  configs[2].max_split_size_bytes = 20 * MiB;
  configs[2].max_non_split_rounding_bytes = 30 * MiB;
  configs[3].roundup_power2_divisions = 4;
  std::vector<CachingAllocator::RangeView> ranges;
  for (std::size_t ci = 0; ci < configs.size(); ++ci) {
    SCOPED_TRACE("config " + std::to_string(ci));
    CachingAllocator real(configs[ci]);
    PlainAllocator plain(configs[ci]);
    std::mt19937_64 rng(2024 + ci);
    std::vector<std::uint64_t> common;
    for (int k = 0; k < 40; ++k) {
      const std::uint64_t scale = k % 3 == 0 ? 4 * KiB : k % 3 == 1 ? 256 * KiB : 6 * MiB;
      common.push_back(1 + rng() % scale);
    }
    struct Live {
      Id id;
      std::uint64_t address;
    };
    std::vector<Live> live;
    for (int step = 0; step < 12000; ++step) {
      const int phase = (step / 1500) % 2;  // 0: mostly allocate, 1: mostly free
      const bool do_alloc = live.empty() || rng() % 100 < (phase == 0 ? 70u : 30u);
      if (do_alloc) {
        const std::uint64_t kind = rng() % 8;
        const std::uint64_t bytes = kind < 5   ? common[rng() % common.size()]
                                    : kind == 5 ? rng() % (2 * MiB)
                                    : kind == 6 ? rng() % (24 * MiB)
                                                : rng() % (90 * MiB);
        const int stream = rng() % 5 == 0 ? 1 : 0;
        const Id id = real.allocate(bytes, stream);
        const std::uint64_t address = plain.allocate(bytes, stream);
        live.push_back({id, address});
      } else {
        const std::size_t pick = rng() % 2 ? live.size() - 1 : rng() % live.size();
        real.release(live[pick].id);
        plain.release(live[pick].address);
        live[pick] = live.back();
        live.pop_back();
      }
      if (step % 2000 == 1999) {
        real.empty_cache();
        plain.empty_cache();
      }
      plain.expect_same_layout(real, ranges);
      if (::testing::Test::HasFatalFailure()) {
        ADD_FAILURE() << "first difference after operation " << step;
        return;
      }
      if (do_alloc) {
        // The block handed out is the one the plain model picked.
        const auto at = std::find_if(ranges.begin(), ranges.end(),
                                     [&](const CachingAllocator::RangeView& r) { return r.id == live.back().id; });
        ASSERT_NE(at, ranges.end());
        ASSERT_EQ(at->address, live.back().address) << "operation " << step;
      }
    }
  }
}
}  // namespace
}  // namespace trainmem::sim
