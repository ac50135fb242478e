"""The Lua scripts deltasync runs on Redis, each declared once.

A script is called by its SHA-1 (EVALSHA) and sent to a server only when that
server does not know it yet (after a restart or a SCRIPT FLUSH), so a heartbeat
costs one short command, not the script's text every time.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis


class Script:
    """A Lua script sent once per server: called by its sha1 (EVALSHA), loaded on a miss."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: list[str], *args: Any) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


# A replica's heartbeat: stamp with the server's clock, store, expire and index in one step.
# KEYS: replica, replicas index. ARGV: node, version, state hash, ttl ms, lease s.
REPORT_REPLICA = Script("""
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'version', ARGV[2], 'state_hash', ARGV[3],
           'time', now, 'lease', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
return now
""")

# A failed sync: the first failure of a streak sets "since"; every failure renews the rest.
# KEYS: failing record, failing index. ARGV: node, held version, error, ttl ms.
REPORT_FAILURE = Script("""
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
redis.call('HSETNX', KEYS[1], 'since', now)
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'held', ARGV[2], 'error', ARGV[3], 'last', now)
redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[1])
return now
""")

# Release or extend a lock only while it still holds our token. KEYS: lock. ARGV: token[, ms].
RELEASE_LOCK = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")
EXTEND_LOCK = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
""")

# Take a lock over from a holder known to be dead, only if it still holds it.
# KEYS: lock. ARGV: dead holder's token, our token, lease ms.
TAKE_OVER_LOCK = Script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
""")

# A sharded step's rank registers; 1 when this made every rank of its launch registered.
# KEYS: shards hash. ARGV: rank, entry JSON, launch, world, ttl ms. Entries of another
# launch (an earlier attempt at the step) are neither counted nor completed with.
REGISTER_RANK = Script("""
local function launch_of(raw)
  local ok, doc = pcall(cjson.decode, raw)
  if ok and type(doc) == 'table' then return doc['launch'] end
  return nil
end
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if old and launch_of(old) == ARGV[3] then return 0 end
local n = 0
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  if launch_of(raw) == ARGV[3] then n = n + 1 end
end
if n == tonumber(ARGV[4]) then return 1 end
return 0
""")
