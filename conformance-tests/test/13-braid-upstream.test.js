// 13. A Braid-native upstream (lib/braid-origin.js, braid-http 1.3.80's own
// server side). The proxy is a wire that fans out (issue 19): the client's
// own request goes upstream (its Subscribe value, its Heartbeats or none,
// its Parents), the 209 and every update reach the client as the origin
// sent them, equivalent clients share ONE upstream subscription, the
// origin's end or reset ends the clients' streams (they resume with
// Parents, as braid-http's retry does), and the origin's refusals reach
// the client as given. A client resuming from a version in the window of a
// live upstream subscription is served from it.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { startBraidOrigin } from '../lib/braid-origin.js'
import { startProxy } from '../lib/proxy.js'
import { subscribe, isSnapshot } from '../lib/client.js'
import { withSubs } from '../lib/harness.js'
import { codePoints } from '../lib/patch.js'
import { sleep, waitFor } from '../lib/util.js'

const TEST_TIMEOUT = { timeout: 60000 }

// Runs fn({origin, proxy, subs}) with a fresh Braid origin and a proxy in
// front of it; stops both and closes the subscriptions in `subs` afterwards.
async function withBraidProxy(originOpts, fn) {
  const origin = await startBraidOrigin(originOpts)
  let proxy
  let failed = false
  try {
    proxy = await startProxy({ upstream: origin.url, pollInterval: '100ms' })
    return await withSubs((subs) => fn({ origin, proxy, subs }))
  } catch (e) {
    failed = true
    if (proxy?.exited) e.message += `\n--- braid-proxy exited (${JSON.stringify(proxy.exited)}); output ---\n${proxy.output()}`
    throw e
  } finally {
    const crashed = proxy?.exited
    const stopped = await proxy?.stop()
    await origin.close()
    if (!failed && crashed)
      throw new Error(`braid-proxy exited during the test (${JSON.stringify(crashed)})\n--- output ---\n${proxy.output()}`)
    if (!failed && stopped?.forced) throw new Error('braid-proxy did not exit within 5 s of SIGTERM (it was killed)')
  }
}

// Text patches against `text` (the document before the update), in code points.
function cpIndex(text, needle) {
  const i = text.indexOf(needle)
  assert.ok(i >= 0, `test bug: ${JSON.stringify(needle)} not in ${JSON.stringify(text)}`)
  return codePoints(text.slice(0, i))
}
const insertAt = (text, needle, content) => {
  const at = cpIndex(text, needle)
  return { unit: 'text', range: `[${at}:${at}]`, content }
}
const replace = (text, needle, content) => {
  const at = cpIndex(text, needle)
  return { unit: 'text', range: `[${at}:${at + codePoints(needle)}]`, content }
}

const append = (text, content) => ({ unit: 'text', range: `[${codePoints(text)}:${codePoints(text)}]`, content })

// Stores `version` on the origin from patches computed on its current text.
const edit = (origin, path, version, makePatches) =>
  origin.set(path, null, { version, patches: makePatches(origin.text(path)) })

const waitAll = (clients, version, ms = 10000) => Promise.all(clients.map((c) => c.waitForVersion(version, ms)))
const versionsOf = (c) => c.updates.map((u) => u.version?.[0])

// Every update's version comes later in `order` than the one before (no
// duplicate, nothing out of order), and every update after the first names
// the previous one as its parent (no gap).
function assertChain(c, order, label) {
  const seen = versionsOf(c)
  for (const [i, v] of seen.entries()) {
    assert.ok(order.includes(v), `${label}: update ${i} has version ${JSON.stringify(v)}, not one of the origin's ${JSON.stringify(order)}`)
    if (i === 0) continue
    assert.ok(order.indexOf(v) > order.indexOf(seen[i - 1]), `${label}: versions out of order or repeated: ${JSON.stringify(seen)}`)
    assert.deepEqual(c.updates[i].parents, [seen[i - 1]], `${label}: update ${i} (${v}) must have Parents = the previous version ${seen[i - 1]}`)
  }
}

const LONG_TAIL = Array.from({ length: 12 }, (_, i) => `Line ${i}: the quick brown 🦊 jumps over the lazy 🐶.\n`).join('')

// A subscriber that retries as braid-http's clients do, resuming with
// Parents = the version it has.
async function retrying(url) {
  let replica
  replica = await subscribe(url, { retry: true, parents: () => replica?.version ?? undefined })
  return replica
}

test('(a) three clients share one upstream subscription, made of the first client\'s own request, and see the origin\'s updates', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/shared.txt'
    origin.set(PATH, 'Shared 📄 doc: alpha beta gamma\n', { version: 'v1' })

    // All three at once, so that a proxy that races would open several upstream streams.
    const clients = await Promise.all([0, 1, 2].map(() => subscribe(proxy.url + PATH)))
    subs.push(...clients)
    await waitAll(clients, 'v1')

    const order = ['v1']
    const steps = [
      ['v2', (t) => [insertAt(t, 'doc', '(draft ✍️) ')]], // after an astral character
      ['v3', (t) => [replace(t, 'alpha', 'ALPHA'), replace(t, 'gamma', 'Γ 🎉')]], // two patches in one update
      ['v4', (t) => [replace(t, ' beta', '')]], // a deletion
      ['v5', (t) => [insertAt(t, '\n', ' — done ✅')]],
    ]
    for (const [v, patches] of steps) {
      edit(origin, PATH, v, patches)
      order.push(v)
      await waitAll(clients, v)
      for (const [k, c] of clients.entries()) assert.equal(c.text, origin.text(PATH), `client ${k} at ${v} equals the origin`)
    }

    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 1, `the origin got exactly one Subscribe request for ${PATH}, got ${reqs.length}`)
    assert.equal(reqs[0].subscribe, 'true', 'the client\'s Subscribe value')
    assert.equal(reqs[0].heartbeats, undefined, 'no Heartbeats the client did not ask for')
    assert.equal(reqs[0].parents, undefined, 'the first upstream subscription has no Parents')
    assert.equal(reqs[0].status, 209)
    assert.equal(origin.liveSubscriptions(PATH), 1, 'one live upstream subscription')

    await sleep(600)
    const polls = origin.plainGets(PATH).length
    assert.equal(polls, 0, `the proxy polled the Braid upstream (${polls} plain GETs of ${PATH})`)

    for (const [k, c] of clients.entries()) {
      c.check()
      assert.deepEqual(versionsOf(c), order, `client ${k} saw every origin version, in order, with the origin's ids`)
      assert.ok(isSnapshot(c.updates[0]), `client ${k}: the first update is the origin's snapshot`)
      assert.equal(c.updates[0].body_text, 'Shared 📄 doc: alpha beta gamma\n', `client ${k}: snapshot of v1`)
      assertChain(c, order, `client ${k}`)
      for (const [i, u] of c.updates.entries()) {
        if (i === 0) continue
        assert.ok(u.patches?.length > 0, `client ${k}: ${u.version} arrives as the origin's patches`)
      }
    }

    // A client asking for heartbeats is not equivalent: its own request goes upstream, as asked.
    const beating = await subscribe(proxy.url + PATH, { heartbeats: 0.5 })
    subs.push(beating)
    await beating.waitForVersion('v5')
    const again = origin.subscribeRequests(PATH)
    assert.equal(again.length, 2)
    assert.equal(again[1].heartbeats, '0.5s', 'Heartbeats as the client asked (sub-second)')
    assert.equal(beating.res.headers.get('heartbeats'), '0.5s', 'the origin\'s 209 headers reach the client')
  })
})

test('(b) an ended or reset upstream stream ends the clients\' streams; retrying clients resume with Parents and miss nothing', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/reconnect.txt'
    origin.set(PATH, 'Reconnect 🔌 log:\n', { version: 'v1' })
    const clients = await Promise.all([0, 1].map(() => retrying(proxy.url + PATH)))
    subs.push(...clients)
    await waitAll(clients, 'v1')
    const order = ['v1']
    const line = (v) => (t) => [append(t, `entry ${v} ✓\n`)]
    const change = async (v, { wait = true } = {}) => {
      edit(origin, PATH, v, line(v))
      order.push(v)
      if (wait) await waitAll(clients, v)
    }
    await change('v2')
    await change('v3')
    assert.equal(origin.subscribeRequests(PATH).length, 1)

    for (const [how, last, missed, after] of [
      ['destroy', 'v3', 'v4', 'v5'],
      ['end', 'v5', 'v6', 'v7'],
    ]) {
      const before = origin.subscribeRequests(PATH).length
      assert.equal(origin.dropSubscriptions(PATH, { how }), 1, 'one upstream subscription to drop')
      await change(missed, { wait: false })
      await waitFor(() => origin.subscribeRequests(PATH).length > before, 8000, {
        message: `no client resumed within 8 s after the upstream stream was ${how === 'end' ? 'ended' : 'reset'}`,
      })
      const again = origin.subscribeRequests(PATH).slice(before)
      for (const r of again) {
        assert.equal(r.parents, JSON.stringify(last), `after a ${how}, the client resumes with Parents: "${last}"`)
        assert.equal(r.status, 209)
      }
      await waitAll(clients, missed)
      await change(after)
    }
    const reqs = origin.subscribeRequests(PATH)
    assert.ok(reqs.length >= 3 && reqs.length <= 5, `one initial subscription and one or two per drop, got ${reqs.length}`)
    for (const [k, c] of clients.entries()) {
      c.check()
      assert.equal(c.text, origin.text(PATH), `client ${k} converged to the origin body`)
      assert.equal(c.versionId, 'v7')
      for (const v of ['v4', 'v6'])
        assert.ok(versionsOf(c).includes(v), `client ${k} got ${v}, the change made while it was disconnected: ${JSON.stringify(versionsOf(c))}`)
    }
  })
})

for (const status of [309, 410, 432]) {
  test(`(c) a resume the origin answers ${status} reaches the client as ${status}`, TEST_TIMEOUT, async () => {
    await withBraidProxy({ unknownParents: status }, async ({ origin, proxy, subs }) => {
      const PATH = '/forgotten.txt'
      origin.set(PATH, 'Title: forgotten history 🕳️\n' + LONG_TAIL, { version: 'v1' })
      const c = await subscribe(proxy.url + PATH)
      subs.push(c)
      await c.waitForVersion('v1')
      edit(origin, PATH, 'v2', (t) => [replace(t, 'Line 3', 'LINE 3')])
      await c.waitForVersion('v2')
      origin.forgetHistory(PATH)
      // Its last client gone, the upstream subscription closes at once
      // (--resource-idle is 30 s): a resume then goes to the origin.
      c.close()
      await waitFor(() => origin.liveSubscriptions(PATH) === 0, 3000, { message: 'the upstream subscription was not closed when its last client left' })

      const res = await fetch(proxy.url + PATH, { headers: { subscribe: 'true', parents: '"v1"' } })
      assert.equal(res.status, status, `the origin's ${status}, not the proxy's own answer`)
      await res.arrayBuffer()
      const reqs = origin.subscribeRequests(PATH)
      assert.equal(reqs.filter((r) => r.status === status).length, 1, `one request answered ${status}: the proxy did not retry it`)
      assert.equal(reqs.at(-1).parents, '"v1"', 'the client\'s Parents went upstream')
    })
  })
}

test('(d) a client resuming from a version the proxy has seen gets only what it missed', TEST_TIMEOUT, async () => {
  await withBraidProxy({}, async ({ origin, proxy, subs }) => {
    const PATH = '/window.txt'
    origin.set(PATH, 'Window 🪟: one\n', { version: 'v1' })
    const rec = await subscribe(proxy.url + PATH)
    subs.push(rec)
    await rec.waitForVersion('v1')
    const words = { v2: 'two', v3: 'three 3️⃣', v4: 'four', v5: 'five ✋' }
    for (const [v, w] of Object.entries(words)) {
      edit(origin, PATH, v, (t) => [insertAt(t, '\n', `, ${w}`)])
      await rec.waitForVersion(v)
    }
    const v3Body = origin.bodyAt(PATH, 'v3')

    const late = await subscribe(proxy.url + PATH, { parents: ['v3'] }, { initial: { body: v3Body, version: ['v3'] } })
    subs.push(late)
    await late.waitForVersion('v5')
    assert.equal(late.text, origin.text(PATH), 'the resumed client converges')
    assert.ok(late.updates.length >= 1 && late.updates.length <= 2, `one or two updates for v4 and v5, got ${late.updates.length}`)
    assert.deepEqual(late.updates[0].parents, ['v3'], 'the first update builds on v3')
    for (const u of late.updates) assert.ok(!isSnapshot(u), `${u.version} is patches, not a snapshot`)
    assert.ok(versionsOf(late).every((v) => v === 'v4' || v === 'v5'), `only the missed versions: ${JSON.stringify(versionsOf(late))}`)
    assertChain(late, ['v3', 'v4', 'v5'], 'resumed client')

    // Resuming at the current version: nothing until the next change.
    const current = await subscribe(proxy.url + PATH, { parents: ['v5'] }, { initial: { body: origin.text(PATH), version: ['v5'] } })
    subs.push(current)
    await sleep(500)
    current.check()
    assert.equal(current.updates.length, 0, `no update while nothing changed, got ${JSON.stringify(versionsOf(current))}`)
    edit(origin, PATH, 'v6', (t) => [insertAt(t, '\n', ', six')])
    await waitAll([rec, late, current], 'v6')
    assert.equal(current.updates.length, 1)
    assert.deepEqual(current.updates[0].parents, ['v5'])
    for (const c of [rec, late, current]) assert.equal(c.text, origin.text(PATH))

    // The proxy served both resumes itself.
    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 1, `still one upstream subscription, got ${reqs.length} Subscribe requests: ${JSON.stringify(reqs.map((r) => r.parents ?? null))}`)
    assert.equal(origin.liveSubscriptions(PATH), 1)
  })
})

test('(e) a snapshot from the upstream (live, or answering a resume) reaches clients as the origin sent it', TEST_TIMEOUT, async () => {
  await withBraidProxy({ unknownParents: 'snapshot' }, async ({ origin, proxy, subs }) => {
    const PATH = '/snapshots.txt'
    const v1 = 'Snapshots 📸\n' + LONG_TAIL
    origin.set(PATH, v1, { version: 'v1' })
    const c = await retrying(proxy.url + PATH)
    subs.push(c)
    await c.waitForVersion('v1')

    // A live update that is a full body (with Parents) instead of patches.
    origin.set(PATH, v1.replace('Line 7', 'Line seven 7️⃣'), { version: 'v2', snapshot: true })
    await c.waitForVersion('v2')
    assert.equal(c.text, origin.text(PATH))
    assert.ok(isSnapshot(c.updates.at(-1)), 'the snapshot is relayed, not diffed')

    // The client's resume is answered 209 with a snapshot, because v2 was forgotten.
    origin.dropSubscriptions(PATH)
    edit(origin, PATH, 'v3', (t) => [replace(t, 'Snapshots', 'SNAPSHOTS')])
    edit(origin, PATH, 'v4', (t) => [replace(t, 'Line 2:', 'Line two:')])
    origin.forgetHistory(PATH)
    await c.waitForVersion('v4')
    c.check()
    assert.equal(c.text, origin.text(PATH))
    assert.ok(isSnapshot(c.updates.at(-1)), 'the resume snapshot is relayed as the origin sent it')
    const reqs = origin.subscribeRequests(PATH)
    assert.equal(reqs.length, 2, 'one resubscription, by the client')
    assert.equal(reqs[1].parents, '"v2"')
    assert.equal(reqs[1].status, 209)
  })
})
