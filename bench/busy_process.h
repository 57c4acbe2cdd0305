// A competing busy process for the contended measurement of `normuon bench`: a forked child that spins
// on one processor until the object goes away (it is killed and reaped then, also on an exception).
#pragma once

#include <sys/types.h>

namespace normuon::bench {

class BusyProcess {
 public:
  BusyProcess();  // throws std::runtime_error when fork fails
  ~BusyProcess();
  BusyProcess(const BusyProcess&) = delete;
  BusyProcess& operator=(const BusyProcess&) = delete;

 private:
  pid_t pid_ = -1;
};

}  // namespace normuon::bench
