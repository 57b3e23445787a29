#include "tiers/remote/reservation_table.h"

namespace cascade::remote {

std::optional<ReservationTable::Reservation> ReservationTable::take(const BlockId& id, int writer,
                                                                    uint64_t offset) {
  auto it = live_.find(id);
  if (it == live_.end() || it->second.writer != writer || it->second.extent.offset != offset)
    return std::nullopt;
  Reservation r = it->second;
  live_.erase(it);
  return r;
}

size_t ReservationTable::expire(Clock::time_point now) {
  size_t n = 0;
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->second.deadline <= now) {
      quarantine_.emplace(it->second.writer, it->second.extent);
      it = live_.erase(it);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

std::optional<Extent> ReservationTable::take_quarantined(int writer, uint64_t offset) {
  auto [lo, hi] = quarantine_.equal_range(writer);
  for (auto it = lo; it != hi; ++it) {
    if (it->second.offset == offset) {
      Extent e = it->second;
      quarantine_.erase(it);
      return e;
    }
  }
  return std::nullopt;
}

std::vector<Extent> ReservationTable::drop_writer(int writer) {
  std::vector<Extent> out;
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->second.writer == writer) {
      out.push_back(it->second.extent);
      it = live_.erase(it);
    } else {
      ++it;
    }
  }
  auto [lo, hi] = quarantine_.equal_range(writer);
  for (auto it = lo; it != hi; ++it) out.push_back(it->second);
  quarantine_.erase(lo, hi);
  return out;
}

std::vector<Extent> ReservationTable::drop_all() {
  std::vector<Extent> out;
  for (auto& [id, r] : live_) out.push_back(r.extent);
  for (auto& [w, e] : quarantine_) out.push_back(e);
  live_.clear();
  quarantine_.clear();
  return out;
}

std::optional<ReservationTable::Clock::time_point> ReservationTable::next_deadline() const {
  std::optional<Clock::time_point> t;
  for (auto& [id, r] : live_)
    if (!t || r.deadline < *t) t = r.deadline;
  return t;
}

}  // namespace cascade::remote
