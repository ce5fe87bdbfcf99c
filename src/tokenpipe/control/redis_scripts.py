"""The Lua scripts of the Redis store (`redis_backend`): each one round trip, atomic.

Every script first refills the scope's buckets from Redis' own clock (`TIME`, so replicas
need no synchronised clocks) and reads every field as a number it bounds, as the local
buckets are: another replica may have written garbage (hostile or older code).

A scope's hash: `rl`/`tl` the request and token levels, `ru`/`tu` when they were last
refilled, `rs`/`ts` the requests and tokens reserved so far (a reservation's sequence number,
which corrects a level learned from headers by what was sent after it), `pu` paused until,
`ep` the epoch that started the count (a Redis that lost its data starts a new one).
"""

from __future__ import annotations

from tokenpipe.control.bounds import MAX_PAUSE
from tokenpipe.control.bucket import MAX_DEBT

#: Scope keys expire after a day without traffic (seconds).
KEY_TTL = 86_400

#: A lease (`redis_backend.Lease`) is granted only while a bucket's level, after the
#: reservation, is above this share of its capacity: near a limit, every request asks Redis.
LEASE_ABOVE = 0.25

# Times inside Redis are seconds since this offset, so a double keeps microseconds when
# Lua turns it into a string (%.14g).
_NOW = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - 1700000000) + tonumber(t[2]) / 1000000
-- What another replica wrote may be garbage, NaN or infinite (hostile or older code):
-- every field read is checked and bounded as the local buckets are.
local function num(x, default)
  x = tonumber(x)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return default end
  return x
end
local function level(l, u, rate, cap)
  l = num(l, nil)
  if l == nil or l >= cap then return cap end
  l = math.max(-MAX_DEBT * cap, l)
  return math.min(cap, l + math.max(0, now - num(u, now)) * rate)
end
local rr, rc, tr, tc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local h = redis.call('HMGET', KEYS[1], 'rl', 'ru', 'tl', 'tu', 'rs', 'ts', 'pu', 'ep')
local ep = h[8]
if not ep or not string.match(ep, '^%d+$') or string.len(ep) > 18 then
  ep = string.format('%d', math.floor(now * 1000000))
  redis.call('HSET', KEYS[1], 'ep', ep)
end
local rl, tl = nil, nil
if rr > 0 then rl = level(h[1], h[2], rr, rc) end
if tr > 0 then tl = level(h[3], h[4], tr, tc) end
local rs, ts = num(h[5], 0), num(h[6], 0)
"""
_SAVE = """
if rl then redis.call('HSET', KEYS[1], 'rl', rl, 'ru', now) end
if tl then redis.call('HSET', KEYS[1], 'tl', tl, 'tu', now) end
redis.call('EXPIRE', KEYS[1], KEY_TTL)
"""

# ARGV: rr rc tr tc tokens back_r back_t share max_r max_t
#   -> {wait, rs, ts, rl, tl, ep, lease_r, lease_t}
# back_r, back_t: what a lease that ended left (negative: what was charged to it past its
# units), given back before deciding. share > 0 asks for a lease once granted: that share of
# each bucket's level above LEASE_ABOVE of its capacity, at most max_r requests and max_t
# tokens, reserved as sent requests are (rs and ts count it); or no lease (-1) when a limited
# bucket would lease less than one unit. A bucket not limited leases 0: it is not counted.
RESERVE = (
    _NOW
    + """
local n = tonumber(ARGV[5])
local back_r, back_t = tonumber(ARGV[6]), tonumber(ARGV[7])
if rl and back_r ~= 0 then rl = math.max(-MAX_DEBT * rc, math.min(rc, rl + back_r)) end
if tl and back_t ~= 0 then tl = math.max(-MAX_DEBT * tc, math.min(tc, tl + back_t)) end
local wait = 0
local pu = num(h[7], 0)
if pu > now + MAX_PAUSE then
  pu = now + MAX_PAUSE
  redis.call('HSET', KEYS[1], 'pu', pu)
end
if pu > now then wait = pu - now end
if rl and rl < 1 then wait = math.max(wait, (1 - rl) / rr) end
if tl then
  local need = math.min(n, tc)
  if tl < need then wait = math.max(wait, (need - tl) / tr) end
end
local lr, lt = -1, -1
if wait == 0 then
  rs = rs + 1
  ts = ts + n
  if rl then rl = math.max(-MAX_DEBT * rc, rl - 1) end
  if tl then tl = math.max(-MAX_DEBT * tc, tl - n) end
  local share = tonumber(ARGV[8])
  if share > 0 then
    lr, lt = 0, 0
    if rl then lr = math.floor(math.min(tonumber(ARGV[9]), (rl - rc * LEASE_ABOVE) * share)) end
    if tl then lt = math.floor(math.min(tonumber(ARGV[10]), (tl - tc * LEASE_ABOVE) * share)) end
    if (rl and lr < 1) or (tl and lt < 1) then
      lr, lt = -1, -1
    else
      if rl then rl = rl - lr; rs = rs + lr end
      if tl then tl = tl - lt; ts = ts + lt end
    end
  end
  redis.call('HSET', KEYS[1], 'rs', rs, 'ts', ts)
end
"""
    + _SAVE
    + """
return {tostring(wait), tostring(rs), tostring(ts), tostring(rl or ''), tostring(tl or ''), ep,
        tostring(lr), tostring(lt)}
"""
)

# ARGV: rr rc tr tc remaining_r remaining_t seq_r seq_t ep ('' = unknown) back_r back_t
# back_r, back_t: what the learning replica's lease left, given back once the level is set
# (the lease's units were counted as sent after seq_r, seq_t).
LEARN = (
    _NOW
    + """
local same = tonumber(ARGV[9]) == tonumber(ep)
local back_r, back_t = tonumber(ARGV[10]), tonumber(ARGV[11])
if rl and ARGV[5] ~= '' then
  local after = 0
  if same then after = rs - tonumber(ARGV[7]) end
  rl = math.max(-MAX_DEBT * rc, math.min(rc, tonumber(ARGV[5]) - after))
end
if tl and ARGV[6] ~= '' then
  local after = 0
  if same then after = ts - tonumber(ARGV[8]) end
  tl = math.max(-MAX_DEBT * tc, math.min(tc, tonumber(ARGV[6]) - after))
end
if rl and back_r ~= 0 then rl = math.max(-MAX_DEBT * rc, math.min(rc, rl + back_r)) end
if tl and back_t ~= 0 then tl = math.max(-MAX_DEBT * tc, math.min(tc, tl + back_t)) end
"""
    + _SAVE
    + """
return 1
"""
)

# ARGV: rr rc tr tc requests tokens (units given back; negative charges)
GIVE = (
    _NOW
    + """
if rl then rl = math.max(-MAX_DEBT * rc, math.min(rc, rl + tonumber(ARGV[5]))) end
if tl then tl = math.max(-MAX_DEBT * tc, math.min(tc, tl + tonumber(ARGV[6]))) end
"""
    + _SAVE
    + """
return 1
"""
)

# ARGV: seconds
PAUSE = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - 1700000000) + tonumber(t[2]) / 1000000
local pu = tonumber(redis.call('HGET', KEYS[1], 'pu')) or 0
if pu ~= pu then pu = 0 end
local s = math.min(tonumber(ARGV[1]), MAX_PAUSE)
redis.call('HSET', KEYS[1], 'pu', math.min(math.max(pu, now + s), now + MAX_PAUSE))
redis.call('EXPIRE', KEYS[1], KEY_TTL)
return 1
"""


def _bounded(script: str) -> str:
    """The script with the bounds shared with the local buckets filled in."""
    for name, value in (
        ("MAX_DEBT", MAX_DEBT),
        ("MAX_PAUSE", MAX_PAUSE),
        ("KEY_TTL", KEY_TTL),
        ("LEASE_ABOVE", LEASE_ABOVE),
    ):
        script = script.replace(name, repr(value))
    return script


RESERVE, LEARN, GIVE, PAUSE = (_bounded(x) for x in (RESERVE, LEARN, GIVE, PAUSE))
