-- A cluster's tenant budgets: one decision (check and reserve every meter of a request) or one correction,
-- atomic (a script runs alone in Redis), so instances never both take the same room (adapters/budgets/cluster_ledger.py).
--
-- The semantics are the core's (core/budgets/meters.py): a window is a token bucket kept as what is
-- used, draining at limit / 60 per second; a period is what requests that ended used plus what those in
-- flight reserved, in a key of its own per day or month (it expires after its period).
--
--   KEYS[1]  the budgets' key prefix, "<key_prefix>:budget"
--   ARGV[1]  { op = "admit", now, meters = [[name, kind, limit, amount, ttl_s]] }
--              kind "w" (a window) or "p" (a period: ttl_s is until its end); reserves all or nothing
--            returns { ok = true, used = [per meter, after] } or { ok = false, wait, over = "rate"|"budget",
--            used = [per meter, before], at = the meter the refusal names (1-based: the first budget over, else
--            the first rate over, as the core's message names it) }
--   ARGV[1]  { op = "take", now, meters = [[name, kind, limit, amount, ttl_s]] }: reserves without a check (a
--            request served over a limit: downgraded, or only reported); returns { ok = true, used = [after] }
--   ARGV[1]  { op = "correct", now, meters = [[name, kind, limit, used_delta, reserved_delta, ttl_s]],
--              usage = { day, ttl, add = [[field, amount]] } (optional: the request's charge, cluster_usage.py) }
--            returns { ok = true }

local P = KEYS[1]
local input = cjson.decode(ARGV[1])
local now = input.now
local EPSILON = 1e-9

-- A window's use, drained to now (a clock behind the last look drains nothing: instances' clocks differ).
local function window(name, limit)
  local k = P .. ':w:' .. name
  local state = redis.call('HMGET', k, 'used', 'at')
  local used, at = tonumber(state[1]) or 0, tonumber(state[2]) or now
  if now > at then
    used = math.max(0, used - (now - at) * limit / 60)
    at = now
  end
  return k, used, at
end

local function period(name)
  local k = P .. ':p:' .. name
  local state = redis.call('HMGET', k, 'used', 'reserved')
  return k, tonumber(state[1]) or 0, tonumber(state[2]) or 0
end

-- Kept until it has drained empty (a debt beyond the limit too), and a minute more.
local function store_window(k, used, at, limit)
  redis.call('HSET', k, 'used', used, 'at', at)
  redis.call('EXPIRE', k, math.ceil(used * 60 / limit) + 60)
end

local function store_period(k, used, reserved, ttl)
  redis.call('HSET', k, 'used', used, 'reserved', math.max(0, reserved))
  redis.call('EXPIRE', k, math.ceil(math.max(ttl, 0)) + 86400)
end

-- Each meter's state now, the time until every one has room for its amount (0: all have; over: which kind), and
-- the meter to name (the first budget over, else the first rate over).
local function look(meters)
  local wait, over, named = 0, nil, nil
  local seen, used = {}, {}
  for i, m in ipairs(meters) do
    local name, kind, limit, amount, ttl = m[1], m[2], m[3], m[4], m[5]
    if kind == 'w' then
      local k, u, at = window(name, limit)
      seen[i], used[i] = {k, u, at}, u
      local excess = u + math.min(amount, limit) - limit
      if excess > EPSILON then
        wait = math.max(wait, excess * 60 / limit)
        if over == nil then
          over, named = 'rate', i
        end
      end
    else
      local k, u, reserved = period(name)
      seen[i], used[i] = {k, u, reserved}, u + reserved
      if u + reserved + amount > limit then
        wait = math.max(wait, ttl)
        if over ~= 'budget' then
          named = i
        end
        over = 'budget'
      end
    end
  end
  return seen, used, wait, over, named
end

local function take(meters, seen)
  local after = {}
  for i, m in ipairs(meters) do
    local kind, amount, ttl = m[2], m[4], m[5]
    local s = seen[i]
    if kind == 'w' then
      store_window(s[1], s[2] + amount, s[3], m[3])
      after[i] = s[2] + amount
    else
      store_period(s[1], s[2], s[3] + amount, ttl)
      after[i] = s[2] + s[3] + amount
    end
  end
  return after
end

if input.op == 'admit' or input.op == 'take' then
  local seen, used, wait, over, named = look(input.meters)
  if over ~= nil and input.op == 'admit' then
    return cjson.encode({ok = false, wait = wait, over = over, used = used, at = named})
  end
  return cjson.encode({ok = true, used = take(input.meters, seen)})
end

if input.op == 'correct' then
  for _, m in ipairs(input.meters) do
    local name, kind, limit, used_delta, reserved_delta, ttl = m[1], m[2], m[3], m[4], m[5], m[6]
    if kind == 'w' then
      local k, used, at = window(name, limit)
      store_window(k, math.max(0, used + used_delta), at, limit)
    else
      local k, used, reserved = period(name)
      store_period(k, used + used_delta, reserved + reserved_delta, ttl)
    end
  end
  local usage = input.usage
  if usage ~= nil then
    local k = P .. ':usage:' .. usage.day
    for _, f in ipairs(usage.add) do
      redis.call('HINCRBYFLOAT', k, f[1], f[2])
    end
    redis.call('EXPIRE', k, usage.ttl)
  end
  return cjson.encode({ok = true})
end

error('no such op: ' .. tostring(input.op))
