-- A cluster's batches: the steps that must be atomic, so instances never run a line twice or record it twice
-- (adapters/batches/cluster_store.py). A script runs alone in Redis.
--
--   KEYS[1]  the batches' key prefix, "<key_prefix>:batches"
--   ARGV[1]  { op, ... } as below; the answer is JSON.
--
-- Every key name, in one place (key() below):
--   batch(id)       hash   the batch: each OpenAI field as JSON text, and _status, _tenant, _seq, _total,
--                          _completed, _failed, _expired (its window ended: no more lines run)
--   active          zset   the batches not final, by creation
--   statuses        hash   status -> batches in it
--   todo(id)        zset   lines to send, not leased, by index (file order)
--   lease(id)       zset   lines leased to an instance, by lease expiry (ms, Redis's clock)
--   owner(id)       hash   index -> the instance holding its lease
--   line(id)        hash   index -> the line as the runner reads it (JSON text)
--   result(id)      hash   index -> its outcome (JSON text), written once
--   token(id)       hash   index -> the token of the attempt that recorded it (a retried record is not a duplicate)
--   lock(id, what)  string the instance validating or finalizing the batch, with a lease
local P = KEYS[1]
local function key(name, id, what)
  if name == 'batch' then return P .. ':batch:' .. id end
  if name == 'active' then return P .. ':active' end
  if name == 'statuses' then return P .. ':statuses' end
  if name == 'lock' then return P .. ':b:' .. id .. ':lock:' .. what end
  if name == 'todo' or name == 'lease' or name == 'owner' or name == 'line' or name == 'result' or name == 'token' then
    return P .. ':b:' .. id .. ':' .. name
  end
  error('no such key: ' .. name)
end

local FINAL = { completed = true, failed = true, expired = true, cancelled = true }
local input = cjson.decode(ARGV[1])
local op = input.op
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function status(id)
  return redis.call('HGET', key('batch', id), '_status')
end

-- Lines run only while the batch is in progress and its window has not ended.
local function running(id)
  return status(id) == 'in_progress' and redis.call('HEXISTS', key('batch', id), '_expired') == 0
end

-- The batch from one status to another, with fields (name -> text as stored); final: no longer active.
local function move(id, to, fields)
  local b = key('batch', id)
  local from = status(id)
  redis.call('HSET', b, '_status', to)
  for name, value in pairs(fields or {}) do
    redis.call('HSET', b, name, value)
  end
  redis.call('HINCRBY', key('statuses'), from, -1)
  redis.call('HINCRBY', key('statuses'), to, 1)
  if FINAL[to] then
    redis.call('ZREM', key('active'), id)
  end
end

-- Leases past their expiry: the line goes back to be sent (its instance died or lost Redis).
local function lapse(id)
  local lapsed = redis.call('ZRANGEBYSCORE', key('lease', id), '-inf', now_ms)
  for _, index in ipairs(lapsed) do
    redis.call('ZREM', key('lease', id), index)
    redis.call('HDEL', key('owner', id), index)
    redis.call('ZADD', key('todo', id), tonumber(index), index)
  end
end

if op == 'move' then
  -- { id, from = [statuses], to, fields }: moved only from one of `from`.
  local now = status(input.id)
  for _, from in ipairs(input.from) do
    if now == from then
      move(input.id, input.to, input.fields)
      return cjson.encode({ moved = true, status = input.to })
    end
  end
  return cjson.encode({ moved = false, status = now or cjson.null })
end

if op == 'begin' then
  -- { id, total, bad, fields }: validated; in progress (a batch cancelled meanwhile stays cancelling).
  local b = key('batch', input.id)
  redis.call('HSET', b, '_total', input.total, '_completed', 0, '_failed', input.bad)
  if status(input.id) == 'validating' then
    move(input.id, 'in_progress', input.fields)
  end
  return cjson.encode({ status = status(input.id) })
end

if op == 'claim' then
  -- { id, me, n, lease_ms }: up to n lines leased to `me`, in file order: [[index, line]].
  if not running(input.id) then
    return cjson.encode({ lines = {}, running = false })
  end
  lapse(input.id)
  local taken = redis.call('ZRANGE', key('todo', input.id), 0, input.n - 1)
  local lines = {}
  for _, index in ipairs(taken) do
    redis.call('ZREM', key('todo', input.id), index)
    redis.call('ZADD', key('lease', input.id), now_ms + input.lease_ms, index)
    redis.call('HSET', key('owner', input.id), index, input.me)
    lines[#lines + 1] = { tonumber(index), redis.call('HGET', key('line', input.id), index) }
  end
  return cjson.encode({ lines = lines, running = true })
end

if op == 'renew' then
  -- { id, me, held = [index], lease_ms }: `me`'s leases extended; those no longer its own are `lost`.
  local lost = {}
  for _, index in ipairs(input.held) do
    local field = tostring(index)
    if redis.call('HGET', key('owner', input.id), field) == input.me then
      redis.call('ZADD', key('lease', input.id), 'XX', now_ms + input.lease_ms, field)
    else
      lost[#lost + 1] = index
    end
  end
  return cjson.encode({ lost = lost, running = running(input.id) })
end

if op == 'release' then
  -- { id, me, held = [index] }: lines `me` stops without an answer go back to be sent at once.
  for _, index in ipairs(input.held) do
    local field = tostring(index)
    if redis.call('HGET', key('owner', input.id), field) == input.me then
      redis.call('ZREM', key('lease', input.id), field)
      redis.call('HDEL', key('owner', input.id), field)
      if redis.call('HEXISTS', key('result', input.id), field) == 0 then
        redis.call('ZADD', key('todo', input.id), index, field)
      end
    end
  end
  return cjson.encode({ ok = true })
end

if op == 'record' then
  -- { id, index, ok, result, token }: the line's outcome, once, while the batch runs: "recorded", "duplicate"
  -- (another attempt's came first), "closed". The same attempt's record sent again (its answer was lost) is
  -- "recorded" again, so its runner counts it once.
  local field = tostring(input.index)
  if redis.call('HGET', key('token', input.id), field) == input.token then
    return cjson.encode({ outcome = 'recorded' })
  end
  if not running(input.id) then
    return cjson.encode({ outcome = 'closed' })
  end
  if redis.call('HSETNX', key('result', input.id), field, input.result) == 0 then
    return cjson.encode({ outcome = 'duplicate' })
  end
  redis.call('HSET', key('token', input.id), field, input.token)
  redis.call('ZREM', key('lease', input.id), field)
  redis.call('HDEL', key('owner', input.id), field)
  redis.call('ZREM', key('todo', input.id), field)
  redis.call('HINCRBY', key('batch', input.id), input.ok and '_completed' or '_failed', 1)
  return cjson.encode({ outcome = 'recorded' })
end

if op == 'done' then
  -- { id, fields }: finalizing once every line has its outcome (none to send, none leased).
  if running(input.id) and redis.call('ZCARD', key('todo', input.id)) == 0
      and redis.call('ZCARD', key('lease', input.id)) == 0 then
    move(input.id, 'finalizing', input.fields)
    return cjson.encode({ moved = true })
  end
  return cjson.encode({ moved = false })
end

if op == 'expire' then
  -- { id }: the window ended: no more lines run, the batch is finalized as expired.
  local now = status(input.id)
  if now == 'validating' or now == 'in_progress' then
    redis.call('HSET', key('batch', input.id), '_expired', 1)
  end
  return cjson.encode({ ok = true })
end

if op == 'lock' then
  -- { id, what, me, lease_ms }: taken, or renewed by its holder; false when another holds it.
  local k = key('lock', input.id, input.what)
  if redis.call('SET', k, input.me, 'NX', 'PX', input.lease_ms) or redis.call('GET', k) == input.me then
    redis.call('PEXPIRE', k, input.lease_ms)
    return cjson.encode({ held = true })
  end
  return cjson.encode({ held = false })
end

if op == 'unlock' then
  local k = key('lock', input.id, input.what)
  if redis.call('GET', k) == input.me then
    redis.call('DEL', k)
  end
  return cjson.encode({ ok = true })
end

if op == 'drop' then
  -- { id, when = [statuses] }: the batch's lines and outcomes gone (a validation redone, or the batch final),
  -- only in one of `when`: a batch in progress never loses what it recorded.
  local now = status(input.id)
  for _, allowed in ipairs(input.when) do
    if now == allowed then
      for _, name in ipairs({ 'todo', 'lease', 'owner', 'line', 'result', 'token' }) do
        redis.call('DEL', key(name, input.id))
      end
      return cjson.encode({ dropped = true })
    end
  end
  return cjson.encode({ dropped = false })
end

return redis.error_reply('cluster_store.lua: no such op: ' .. tostring(op))
