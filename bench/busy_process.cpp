#include "busy_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace normuon::bench {

BusyProcess::BusyProcess() {
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error(std::string("bench: cannot fork a busy process: ") + std::strerror(errno));
  if (pid_ == 0) {
    // The child only spins (no library call after fork in a threaded parent), until it is killed.
    volatile uint64_t spins = 0;
    for (;;) spins = spins + 1;
  }
}

BusyProcess::~BusyProcess() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace normuon::bench
