-- One instance's round trip for one model: publish, claim, decide, answer (adapters/cluster/link.py).
--
-- Atomic (a script runs alone in Redis), so two instances can never both take
-- the same free slot or serve the same turn. Keys, under KEYS[1] = "<prefix>:<model>":
--   :inst        hash  instance -> "<lease expiry ms> <requests in flight>"
--   :q           hash  instance -> its backlog: records "band US tenant US count US service US 0", RS-separated
--   :p:<inst>    list  slots granted to <inst> by another's round trip, not yet taken: "band US tenant"
--   :c:<band>    hash  tenant -> counter (weighted service received; round-robin: releases)
--   :s:<band>    hash  tenant -> sequence number of its last release (ties: served longest ago first)
--   :f:<band>    the band's floor: the counter of the last tenant picked
--   :seq         the release sequence
--
-- ARGV: instance, lease_ms, in_flight, wake channel prefix, model, bands, caps[bands],
--       backlog count, (band, tenant, count, service, fresh)*, corrections count, (band, tenant, delta)*
--       (fresh = 1: the tenant's FIFO at the caller was empty since its last round trip)
-- Returns: { others in flight, live instances, band1, tenant1, band2, tenant2, ... } (this instance's releases).

local P = KEYS[1]
local me = ARGV[1]
local lease_ms = tonumber(ARGV[2])
local mine = tonumber(ARGV[3])
local wake = ARGV[4]
local model = ARGV[5]
local nb = tonumber(ARGV[6])
local US, RS = '\31', '\30'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local caps = {}
local i = 7
for b = 0, nb - 1 do
  caps[b] = tonumber(ARGV[i])
  i = i + 1
end

-- Backlogs as lists of {band, tenant, count, service, fresh}. Stored ones are never fresh:
-- a tenant joins the cluster's backlog once, at the round trip of the instance it arrived at.
local function parse(s)
  local out = {}
  if not s then return out end
  for rec in string.gmatch(s, '[^' .. RS .. ']+') do
    local b, ten, c, sv = string.match(rec, '^(%d+)' .. US .. '(.-)' .. US .. '(%d+)' .. US .. '([^' .. US .. ']+)')
    if b then out[#out + 1] = { tonumber(b), ten, tonumber(c), tonumber(sv), false } end
  end
  return out
end

local function encode(list)
  local parts = {}
  for _, e in ipairs(list) do
    if e[3] > 0 then parts[#parts + 1] = e[1] .. US .. e[2] .. US .. e[3] .. US .. e[4] .. US .. '0' end
  end
  return table.concat(parts, RS)
end

local mylist, mine_at = {}, {}
local n = tonumber(ARGV[i])
i = i + 1
for _ = 1, n do
  local e = { tonumber(ARGV[i]), ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), ARGV[i + 4] == '1' }
  mylist[#mylist + 1] = e
  mine_at[e[1] .. US .. e[2]] = e
  i = i + 5
end
n = tonumber(ARGV[i])
i = i + 1
for _ = 1, n do
  redis.call('HINCRBYFLOAT', P .. ':c:' .. ARGV[i], ARGV[i + 1], ARGV[i + 2])
  i = i + 3
end

-- Slots another round trip granted us: ours to release now (they are in our backlog).
local releases = {}
local pending_key = P .. ':p:' .. me
local claimed = redis.call('LRANGE', pending_key, 0, -1)
if #claimed > 0 then redis.call('DEL', pending_key) end
for _, g in ipairs(claimed) do
  local b, ten = string.match(g, '^(%d+)' .. US .. '(.*)$')
  releases[#releases + 1] = tonumber(b)
  releases[#releases + 1] = ten
  local e = mine_at[g]
  if e and e[3] > 0 then e[3] = e[3] - 1 end
end
local mine_after = mine + #claimed

-- The live instances: what each holds in flight (and was granted, not yet taken), and its backlog.
-- An instance whose lease lapsed is gone: its slots come back, its backlog and grants with it.
local total, alive = mine_after, 1
local backlogs = { [me] = mylist }
local inst = redis.call('HGETALL', P .. ':inst')
for k = 1, #inst, 2 do
  local name = inst[k]
  if name ~= me then
    local expiry, flying = string.match(inst[k + 1], '^(%d+) (%d+)$')
    if tonumber(expiry) < now then
      redis.call('HDEL', P .. ':inst', name)
      redis.call('HDEL', P .. ':q', name)
      redis.call('DEL', P .. ':p:' .. name)
    else
      alive = alive + 1
      total = total + tonumber(flying) + redis.call('LLEN', P .. ':p:' .. name)
      backlogs[name] = parse(redis.call('HGET', P .. ':q', name))
    end
  end
end

-- Per band: tenant -> { n = queued in the cluster, at = instance -> its backlog record,
-- fresh = it joins the cluster's backlog now (fresh here, backlogged nowhere else) }.
local cand = {}
for name, list in pairs(backlogs) do
  for _, e in ipairs(list) do
    if e[3] > 0 then
      local byb = cand[e[1]] or {}
      cand[e[1]] = byb
      local c = byb[e[2]] or { n = 0, at = {}, fresh = true }
      byb[e[2]] = c
      c.n = c.n + e[3]
      c.at[name] = e
      c.fresh = c.fresh and e[5]
    end
  end
end

local seq = tonumber(redis.call('GET', P .. ':seq') or '0')
local woken = {}
for b = 0, nb - 1 do
  local byb = cand[b]
  if byb then
    local ckey, skey, fkey = P .. ':c:' .. b, P .. ':s:' .. b, P .. ':f:' .. b
    local floor = tonumber(redis.call('GET', fkey) or '0')
    -- Counters; a tenant joining the backlog is lifted to the smallest counter of those
    -- already in it (or the floor), so idle time is not banked (as policies/vtc.py).
    local names = {}
    for ten, _ in pairs(byb) do names[#names + 1] = ten end
    local backlogged = #names
    local got_c, got_s = redis.call('HMGET', ckey, unpack(names)), redis.call('HMGET', skey, unpack(names))
    local counters, served, lift = {}, {}, nil
    for k, ten in ipairs(names) do
      counters[ten] = tonumber(got_c[k] or floor)
      served[ten] = tonumber(got_s[k] or '0')
      if not byb[ten].fresh and (lift == nil or counters[ten] < lift) then lift = counters[ten] end
    end
    lift = lift or floor
    for ten, c in pairs(byb) do
      if c.fresh and counters[ten] < lift then
        counters[ten] = lift
        redis.call('HSET', ckey, ten, lift)
      end
    end
    -- Each free slot to the backlogged tenant with the smallest counter (ties: served longest
    -- ago, then by name), held here if it is held here, else by the instance holding most of it.
    local free = caps[b] - total
    while free > 0 do
      local best, bc, bs = nil, 0, 0
      for ten, c in pairs(byb) do
        if c.n > 0 then
          local k, sv = counters[ten], served[ten]
          if best == nil or k < bc or (k == bc and (sv < bs or (sv == bs and ten < best))) then
            best, bc, bs = ten, k, sv
          end
        end
      end
      if best == nil then break end
      local c = byb[best]
      local who = nil
      if c.at[me] and c.at[me][3] > 0 then
        who = me
      else
        local most = 0
        for name, e in pairs(c.at) do
          if e[3] > most or (e[3] == most and e[3] > 0 and name < who) then
            who, most = name, e[3]
          end
        end
      end
      local e = c.at[who]
      e[3] = e[3] - 1
      c.n = c.n - 1
      if bc > floor then floor = bc end
      counters[best] = bc + e[4]
      seq = seq + 1
      served[best] = seq
      redis.call('HSET', ckey, best, counters[best])
      redis.call('HSET', skey, best, seq)
      if who == me then
        releases[#releases + 1] = b
        releases[#releases + 1] = best
        mine_after = mine_after + 1
      else
        redis.call('RPUSH', P .. ':p:' .. who, b .. US .. best)
        woken[who] = true
      end
      total = total + 1
      free = free - 1
    end
    redis.call('SET', fkey, floor)
    -- Forget idle tenants at or below the floor: a return lifts them there anyway.
    if redis.call('HLEN', ckey) > 2 * backlogged + 64 then
      local all = redis.call('HGETALL', ckey)
      for k = 1, #all, 2 do
        if byb[all[k]] == nil and tonumber(all[k + 1]) <= floor then
          redis.call('HDEL', ckey, all[k])
          redis.call('HDEL', skey, all[k])
        end
      end
    end
    -- Strict priority: while anyone of this band waits, the bands below wait too.
    local left = false
    for _, c in pairs(byb) do
      if c.n > 0 then left = true break end
    end
    if left then break end
  end
end
redis.call('SET', P .. ':seq', seq)

redis.call('HSET', P .. ':inst', me, string.format('%d %d', now + lease_ms, mine_after))
redis.call('HSET', P .. ':q', me, encode(mylist))
for name, _ in pairs(woken) do
  redis.call('HSET', P .. ':q', name, encode(backlogs[name]))
  redis.call('PUBLISH', wake .. name, model)
end

local reply = { total - mine_after, alive }
for _, v in ipairs(releases) do reply[#reply + 1] = v end
return reply
