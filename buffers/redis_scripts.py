"""The buffer's Lua scripts (``asyncrl.buffers.redis_buffer``): each runs atomically on the server, so racing
processes cannot pass the admission bound, count an outcome twice or lose a held group. Their KEYS and
ARGV are listed above each; the keys are ``asyncrl.keys.RunKeys``'s."""

from __future__ import annotations

from asyncrl.buffers.base import SLOT_RETURNERS, SLOT_TAKERS

# KEYS: counters, once-token, admissions, held, journals. ARGV: limit, ttl, records kept, producer ('' for
# none: nobody holds the group), the journal key prefix, the claim's part. A held group's claim is journaled
# in the same step (owner and part), so it is an orphan if its producer dies at any instant after. Returns
# the new group's sequence number, or -1 when refused; a retry with the same token returns the first answer
# without counting again. ``live`` is
# base.live_groups, spelled in Lua from the same SLOT_TAKERS / SLOT_RETURNERS tuples. Every admission
# is recorded (its sequence number, the groups holding a slot after it, and the limit it was judged
# against), so a run's history can be checked afterwards.
ADMIT = """
local prev = redis.call('GET', KEYS[2])
if prev then return tonumber(prev) end
local takers = redis.call('HMGET', KEYS[1], {takers})
local returners = redis.call('HMGET', KEYS[1], {returners})
local live = 0
for _, v in ipairs(takers) do live = live + (tonumber(v) or 0) end
for _, v in ipairs(returners) do live = live - (tonumber(v) or 0) end
local seq = -1
if live < tonumber(ARGV[1]) then
  seq = tonumber(redis.call('HGET', KEYS[1], 'started')) or 0
  redis.call('HINCRBY', KEYS[1], 'started', 1)
  if ARGV[4] ~= '' then
    redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
    redis.call('HSET', KEYS[5], seq, ARGV[4])
    redis.call('HSET', ARGV[5] .. seq, ARGV[6], '{{}}')
  end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'seq', seq, 'live', live + 1, 'limit', ARGV[1])
end
redis.call('SET', KEYS[2], seq, 'EX', ARGV[2])
return seq
""".format(
    takers=", ".join(f"'{k}'" for k in SLOT_TAKERS),
    returners=", ".join(f"'{k}'" for k in SLOT_RETURNERS),
)

# Lua: the producer ARGV[i] holds n fewer groups in KEYS[k] (never below none: a reaped one's were taken).
UNHOLD = """
local function unhold(key, producer, n)
  local left = (tonumber(redis.call('HGET', key, producer)) or 0) - n
  if left > 0 then redis.call('HSET', key, producer, left) else redis.call('HDEL', key, producer) end
end
"""

# KEYS: counters, once-token, held. ARGV: field, n, ttl, producer ('' for none). Adds n to a counter
# once per token; the producer's n groups are no longer held.
INCR_ONCE = f"""{UNHOLD}
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[3]) then
  redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
  if ARGV[4] ~= '' then unhold(KEYS[3], ARGV[4], tonumber(ARGV[2])) end
end
return 0
"""

# KEYS: counters, held, journals, orphans. ARGV: producer ('' for every producer), resume ('1'/'0'),
# reaped count ('' unless the reaper took the producer's held count already), journal key prefix.
# Counts the groups held as abandoned and holds none, except journaled ones under resume: those become
# orphans (owner '', queued on orphans; their slots stay taken). Without resume, a journal of the
# producer's is dropped, and for every producer, so is each orphan (counted abandoned). Returns the
# count abandoned.
RELEASE_HELD = """
local n = 0
if ARGV[3] ~= '' then
  n = tonumber(ARGV[3])
elseif ARGV[1] == '' then
  local all = redis.call('HGETALL', KEYS[2])
  for i = 2, #all, 2 do n = n + tonumber(all[i]) end
  redis.call('DEL', KEYS[2])
else
  n = tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
  redis.call('HDEL', KEYS[2], ARGV[1])
end
local owners = redis.call('HGETALL', KEYS[3])
for i = 1, #owners, 2 do
  local seq, owner = owners[i], owners[i + 1]
  if owner == '' then
    if ARGV[1] == '' and ARGV[2] ~= '1' then
      redis.call('HDEL', KEYS[3], seq)
      redis.call('DEL', ARGV[4] .. seq)
      n = n + 1
    end
  elseif ARGV[1] == '' or owner == ARGV[1] then
    if ARGV[2] == '1' and n > 0 then
      redis.call('HSET', KEYS[3], seq, '')
      redis.call('RPUSH', KEYS[4], seq)
      n = n - 1
    else
      redis.call('HDEL', KEYS[3], seq)
      redis.call('DEL', ARGV[4] .. seq)
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'abandoned', n) end
return n
"""

# KEYS: journals, the group's journal. ARGV: seq, producer, part, state. Keeps the part unless another
# producer (or nobody: an orphan) owns the group; 1 if kept.
JOURNAL = """
local owner = redis.call('HGET', KEYS[1], ARGV[1])
if owner and owner ~= ARGV[2] then return 0 end
if not owner then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
return 1
"""

# KEYS: journals, orphans, held, counters. ARGV: producer, journal key prefix. The oldest orphan, now the
# producer's (held, counted resumed): {seq, part, state, part, state, ...}; nil when there is none.
TAKE_ORPHAN = """
local seq = redis.call('LPOP', KEYS[2])
while seq do
  if redis.call('HGET', KEYS[1], seq) == '' then
    redis.call('HSET', KEYS[1], seq, ARGV[1])
    redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
    redis.call('HINCRBY', KEYS[4], 'resumed', 1)
    local out = {seq}
    for _, v in ipairs(redis.call('HGETALL', ARGV[2] .. seq)) do out[#out + 1] = v end
    return out
  end
  seq = redis.call('LPOP', KEYS[2])
end
return nil
"""

# KEYS: seen, traj, counters, unacked, held. ARGV: group id, seen window, producer. Runs in one
# MULTI/EXEC right after the XADD of the group, so the newest entry of traj is that XADD's: 1 if it
# stays (counted, its group id marked unacked: that is what tells it from a foreign entry, and no
# longer held by its producer), 0 if the id is a duplicate
# and the entry is deleted again (only then is the frame copied into Lua). Refuses before changing
# anything if traj is not a stream (the XADD failed with WRONGTYPE). The seen set keeps the newest ids
# only (scored by the pushed counter).
PUSH = f"""{UNHOLD}
if redis.call('TYPE', KEYS[2]).ok ~= 'stream' then return redis.error_reply('ERR traj is not a stream') end
local order = (tonumber(redis.call('HGET', KEYS[3], 'pushed')) or 0) + 1
if redis.call('ZADD', KEYS[1], 'NX', order, ARGV[1]) == 0 then
  local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
  redis.call('XDEL', KEYS[2], newest[1])
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return 0
end
redis.call('HINCRBY', KEYS[3], 'pushed', 1)
redis.call('HSET', KEYS[4], ARGV[1], 1)
unhold(KEYS[5], ARGV[3], 1)
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if excess > 0 then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1) end
return 1
"""

# KEYS: unacked. ARGV: (entry id, group id) pairs of entries just delivered. The first entry
# delivered with a pushed group id claims it (push() appended the real one before any copy could
# follow it in the stream); returns 1 per entry that holds its group id's claim, 0 for a foreign one.
# Idempotent: an entry delivered again (a restarted consumer's pending entries) keeps its claim.
CLAIM = """
local out = {}
for i = 1, #ARGV, 2 do
  local mark = redis.call('HGET', KEYS[1], ARGV[i + 1])
  if mark == '1' then
    redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i])
    mark = ARGV[i]
  end
  out[#out + 1] = (mark == ARGV[i]) and 1 or 0
end
return out
"""

# KEYS: traj, counters, unacked. ARGV: consumer group, counter, then (entry id, group id) pairs.
# Deletes only what XACK acknowledged, so an id that was never delivered (or is unknown) cannot make
# a queued entry disappear, and an acknowledgement retried after a lost reply counts nothing twice.
# An entry counts as ``counter`` only if it holds its group id's claim (CLAIM); otherwise it is
# foreign. Returns the entries counted as ``counter``.
ACK = """
local n, foreign = 0, 0
for i = 3, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    if redis.call('HGET', KEYS[3], ARGV[i + 1]) == ARGV[i] then
      redis.call('HDEL', KEYS[3], ARGV[i + 1])
      n = n + 1
    else
      foreign = foreign + 1
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], n) end
if foreign > 0 then redis.call('HINCRBY', KEYS[2], 'foreign', foreign) end
return n
"""

# KEYS: traj, counters, dead, unacked. ARGV: consumer group, entry id, group id, reason, producer,
# size, frame head, dead-letter cap. Acknowledges the entry and keeps the letter; returns 1 (counted
# dead), 2 (foreign) or 0 (acknowledged already: nothing done).
DEAD = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
local outcome = 2
if redis.call('HGET', KEYS[4], ARGV[3]) == ARGV[2] then
  redis.call('HDEL', KEYS[4], ARGV[3])
  outcome = 1
end
redis.call('HINCRBY', KEYS[2], outcome == 1 and 'dead' or 'foreign', 1)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*',
  'reason', ARGV[4], 'producer', ARGV[5], 'size', ARGV[6], 'frame', ARGV[7])
return outcome
"""
