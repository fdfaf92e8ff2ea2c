"""A token bucket: `rate` tokens a second refill it, up to `burst`; what is spent comes out.

The daemon meters three flows with one: requests per client (daemon/intake.py, the HTTP
rate limit), frames from each runner (server/runnerguard.py: past the rate the runner is
stopped) and bytes read from each runner (ipc.SocketTransport: past the rate reading waits).
The caller passes the time, from whichever clock it keeps (the event loop's, a test's).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    rate: float  # tokens a second
    burst: float  # tokens it holds at most
    tokens: float
    at: float  # when `tokens` was last brought up to date

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def level(self, now: float) -> float:
        """The tokens at `now`: what was left, refilled since."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens

    def take(self, n: float, now: float) -> bool:
        """Spend `n` tokens if the bucket holds them (True), else spend none (False)."""
        if self.level(now) < n:
            return False
        self.tokens -= n
        return True

    def spend(self, n: float, now: float) -> float:
        """Spend `n` tokens, into debt if need be; the seconds until the debt is repaid
        (0 when there is none)."""
        self.tokens = self.level(now) - n
        return max(0.0, -self.tokens / self.rate)
