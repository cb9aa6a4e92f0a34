-- One instance's round trip for one model: publish, claim, decide, answer (adapters/cluster/link.py).
--
-- Atomic (a script runs alone in Redis), so two instances can never both take
-- the same free slot or serve the same turn.
--
-- Input and output are JSON with named fields, the schema of adapters/cluster/wire.py:
--   KEYS[1]  the model's key prefix, "<key_prefix>:<model>"
--   ARGV[1]  a Trip: { instance, lease_ms, wake, model, form, ask? }, the ask a core Ask:
--            { in_flight, caps = [per band], backlog = [{ band, tenant, count, service, fresh }],
--              corrections = [{ band, tenant, delta }], shares = [per band] }   (no ask: the instance leaves)
--   returns  a Grant: { others_in_flight, instances, releases = [{ band, tenant }] }
--            (releases omitted when none: cjson writes an empty table as an object)
-- `form` is the policy's cluster form: only "counter" is implemented here (policies/base.py).

local P = KEYS[1]

-- Every key name, in one place:
--   instances       hash  instance -> "<lease expiry ms> <requests in flight>"
--   backlogs        hash  instance -> its backlog, JSON [{ band, tenant, count, service }]
--   pending(inst)   list  slots granted to inst by another's round trip, not yet taken: "band US tenant"
--   counters(band)  hash  tenant -> counter (weighted service received; round-robin: releases)
--   served(band)    hash  tenant -> sequence number of its last release (ties: served longest ago first)
--   floor(band)     the band's floor: the counter of the last tenant picked
--   credits         hash  band -> its credit towards its minimum share of releases
--   sequence        the release sequence
local function key(name, arg)
  if name == 'instances' then return P .. ':inst' end
  if name == 'backlogs' then return P .. ':q' end
  if name == 'pending' then return P .. ':p:' .. arg end
  if name == 'counters' then return P .. ':c:' .. arg end
  if name == 'served' then return P .. ':s:' .. arg end
  if name == 'floor' then return P .. ':f:' .. arg end
  if name == 'sequence' then return P .. ':seq' end
  if name == 'credits' then return P .. ':cr' end
  error('no such key: ' .. name)
end

local US = '\31'

-- An instance gone (its lease lapsed, or it left): its slots come back, its backlog and grants with it.
local function forget(name)
  redis.call('HDEL', key('instances'), name)
  redis.call('HDEL', key('backlogs'), name)
  redis.call('DEL', key('pending', name))
end

local trip = cjson.decode(ARGV[1])
local me = trip.instance
local ask = trip.ask
if ask == nil then
  forget(me)
  return cjson.encode({ others_in_flight = 0, instances = 0 })
end
if trip.form ~= 'counter' then
  return redis.error_reply('schedule.lua implements the cluster form "counter", not "' .. tostring(trip.form) .. '"')
end

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local nb = #ask.caps

-- A stored backlog: its records, never fresh (a tenant joins the cluster's backlog
-- once, at the round trip of the instance it arrived at).
local function stored(s)
  if not s then return {} end
  return cjson.decode(s)
end

local function store(list)
  local kept = {}
  for _, e in ipairs(list) do
    if e.count > 0 then
      kept[#kept + 1] = { band = e.band, tenant = e.tenant, count = e.count, service = e.service }
    end
  end
  if #kept == 0 then return '[]' end
  return cjson.encode(kept)
end

local mylist, mine_at = ask.backlog, {}
for _, e in ipairs(mylist) do
  mine_at[e.band .. US .. e.tenant] = e
end
for _, c in ipairs(ask.corrections) do
  redis.call('HINCRBYFLOAT', key('counters', c.band), c.tenant, c.delta)
end

-- Slots another round trip granted us: ours to release now (they are in our backlog).
local releases = {}
local pending_key = key('pending', me)
local claimed = redis.call('LRANGE', pending_key, 0, -1)
if #claimed > 0 then redis.call('DEL', pending_key) end
for _, g in ipairs(claimed) do
  local b, ten = string.match(g, '^(%d+)' .. US .. '(.*)$')
  releases[#releases + 1] = { band = tonumber(b), tenant = ten }
  local e = mine_at[g]
  if e and e.count > 0 then e.count = e.count - 1 end
end
local mine_after = ask.in_flight + #claimed

-- The live instances: what each holds in flight (and was granted, not yet taken), and its backlog.
local total, alive = mine_after, 1
local backlogs = { [me] = mylist }
local inst = redis.call('HGETALL', key('instances'))
for k = 1, #inst, 2 do
  local name = inst[k]
  if name ~= me then
    local expiry, flying = string.match(inst[k + 1], '^(%d+) (%d+)$')
    if tonumber(expiry) < now then
      forget(name)
    else
      alive = alive + 1
      total = total + tonumber(flying) + redis.call('LLEN', key('pending', name))
      backlogs[name] = stored(redis.call('HGET', key('backlogs'), name))
    end
  end
end

-- Per band: tenant -> { n = queued in the cluster, at = instance -> its backlog record,
-- fresh = it joins the cluster's backlog now (fresh here, backlogged nowhere else) }.
local cand = {}
for name, list in pairs(backlogs) do
  for _, e in ipairs(list) do
    if e.count > 0 then
      local byb = cand[e.band] or {}
      cand[e.band] = byb
      local c = byb[e.tenant] or { n = 0, at = {}, fresh = true }
      byb[e.tenant] = c
      c.n = c.n + e.count
      c.at[name] = e
      c.fresh = c.fresh and e.fresh == true
    end
  end
end

local seq = tonumber(redis.call('GET', key('sequence')) or '0')
local woken = {}

-- A band's turns: its counters, read once, kept as slots go (its tenants lifted as they join).
local state = {}
local function band(b)
  if state[b] then return state[b] end
  local byb = cand[b] or {}
  local st = { byb = byb, ckey = key('counters', b), skey = key('served', b), fkey = key('floor', b),
               counters = {}, served = {}, n = 0 }
  st.floor = tonumber(redis.call('GET', st.fkey) or '0')
  -- Counters; a tenant joining the backlog is lifted to the smallest counter of those
  -- already in it (or the floor), so idle time is not banked (as policies/vtc.py).
  local names = {}
  for ten, c in pairs(byb) do
    names[#names + 1] = ten
    st.n = st.n + c.n
  end
  st.backlogged = #names
  if #names > 0 then
    local got_c, got_s = redis.call('HMGET', st.ckey, unpack(names)), redis.call('HMGET', st.skey, unpack(names))
    local lift = nil
    for k, ten in ipairs(names) do
      st.counters[ten] = tonumber(got_c[k] or st.floor)
      st.served[ten] = tonumber(got_s[k] or '0')
      if not byb[ten].fresh and (lift == nil or st.counters[ten] < lift) then lift = st.counters[ten] end
    end
    lift = lift or st.floor
    for ten, c in pairs(byb) do
      if c.fresh and st.counters[ten] < lift then
        st.counters[ten] = lift
        redis.call('HSET', st.ckey, ten, lift)
      end
    end
  end
  state[b] = st
  return st
end

-- One slot of band b to its backlogged tenant with the smallest counter (ties: served longest
-- ago, then by name), held here if it is held here, else by the instance holding most of it.
local function serve(b)
  local st = band(b)
  local best, bc, bs = nil, 0, 0
  for ten, c in pairs(st.byb) do
    if c.n > 0 then
      local k, sv = st.counters[ten], st.served[ten]
      if best == nil or k < bc or (k == bc and (sv < bs or (sv == bs and ten < best))) then
        best, bc, bs = ten, k, sv
      end
    end
  end
  local c = st.byb[best]
  local who = nil
  if c.at[me] and c.at[me].count > 0 then
    who = me
  else
    local most = 0
    for name, e in pairs(c.at) do
      if e.count > most or (e.count == most and e.count > 0 and name < who) then
        who, most = name, e.count
      end
    end
  end
  local e = c.at[who]
  e.count = e.count - 1
  c.n = c.n - 1
  st.n = st.n - 1
  if bc > st.floor then st.floor = bc end
  st.counters[best] = bc + e.service
  seq = seq + 1
  st.served[best] = seq
  redis.call('HSET', st.ckey, best, st.counters[best])
  redis.call('HSET', st.skey, best, seq)
  if who == me then
    releases[#releases + 1] = { band = b, tenant = best }
    mine_after = mine_after + 1
  else
    redis.call('RPUSH', key('pending', who), b .. US .. best)
    woken[who] = true
  end
  total = total + 1
end

local function waiting(b)
  return cand[b] ~= nil and band(b).n > 0
end

-- Strict priority, but for the minimum shares (core/bands.py, BandShares): while the first band
-- with a backlog takes the slots its cap allows, each band below it with a backlog earns its
-- share of every release (its credit, kept cluster-wide) and takes one when the credit reaches 1.
local credits, band_names = {}, {}
for b = 0, nb - 1 do band_names[b + 1] = tostring(b) end
local stored_credits = redis.call('HMGET', key('credits'), unpack(band_names))
for b = 0, nb - 1 do credits[b] = tonumber(stored_credits[b + 1] or '0') end
local first = 0
while first < nb and not waiting(first) do first = first + 1 end
while first < nb do
  if ask.caps[first + 1] - total <= 0 then break end
  local pick = first
  for lower = first + 1, nb - 1 do
    if waiting(lower) then
      credits[lower] = credits[lower] + (ask.shares and ask.shares[lower + 1] or 0)
      if pick == first and credits[lower] >= 1 then pick = lower end
    else
      credits[lower] = 0
    end
  end
  if pick ~= first then credits[pick] = credits[pick] - 1 end
  serve(pick)
  while first < nb and not waiting(first) do first = first + 1 end
end
for b = 0, nb - 1 do
  if not waiting(b) then credits[b] = 0 end
  redis.call('HSET', key('credits'), band_names[b + 1], credits[b])
end
for b, st in pairs(state) do
  redis.call('SET', st.fkey, st.floor)
  -- Forget idle tenants at or below the floor: a return lifts them there anyway.
  if redis.call('HLEN', st.ckey) > 2 * st.backlogged + 64 then
    local all = redis.call('HGETALL', st.ckey)
    for k = 1, #all, 2 do
      if st.byb[all[k]] == nil and tonumber(all[k + 1]) <= st.floor then
        redis.call('HDEL', st.ckey, all[k])
        redis.call('HDEL', st.skey, all[k])
      end
    end
  end
end
redis.call('SET', key('sequence'), seq)

redis.call('HSET', key('instances'), me, string.format('%d %d', now + trip.lease_ms, mine_after))
redis.call('HSET', key('backlogs'), me, store(mylist))
for name, _ in pairs(woken) do
  redis.call('HSET', key('backlogs'), name, store(backlogs[name]))
  redis.call('PUBLISH', trip.wake .. name, trip.model)
end

local grant = { others_in_flight = total - mine_after, instances = alive }
if #releases > 0 then grant.releases = releases end
return cjson.encode(grant)
