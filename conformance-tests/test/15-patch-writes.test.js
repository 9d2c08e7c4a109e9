// 15. Braid patch writes onto a plain origin (issue 22). braid-http's own
// PUT with `version`, `parents` and `patches` (one patch as Content-Range,
// several as Patches: N) reaches the plain origin as the whole new body
// under If-Match; other subscribers get the writer's patches (Content-Range
// on the wire, not a snapshot) under the writer's version. Concurrent
// writers on one parent: one wins, the others get 409 with Current-Version,
// and every subscriber ends at the origin's body. Bad patches never reach
// the origin.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe, braidFetch, isSnapshot } from '../lib/client.js'
import { rawSubscribe } from '../lib/raw.js'
import { codePoints } from '../lib/patch.js'

const CT = 'text/plain; charset=utf-8'

// Polls are rare here: the proxy learns of writes through itself at once.
const ctx = useProxy({
  pollInterval: '30s',
  seed: (o) => {
    o.set('/one.txt', 'hello world', { contentType: CT })
    o.set('/many.txt', 'Grüße, wörld! 👋 bye', { contentType: CT })
    o.set('/race.txt', 'base', { contentType: CT })
    o.set('/bad.txt', 'untouched', { contentType: CT })
  },
})

const puts = (path) => ctx.origin.requests.filter((r) => r.method === 'PUT' && r.path === path)

/** A braid-http subscriber at the origin's current version, closed after the test. */
async function subscribed(subs, path) {
  const client = await subscribe(ctx.proxy.url + path)
  subs.push(client)
  await client.waitForVersion(ctx.origin.version(path))
  return client
}

async function put(path, { version, parents, patches }) {
  const res = await braidFetch(ctx.proxy.url + path, { method: 'PUT', version, parents, patches })
  const text = await res.text()
  return { status: res.status, headers: res.headers, text }
}

test('braid-http PUT with one patch: the origin gets the whole body, a second subscriber the patch', async () => {
  const { origin, proxy } = ctx
  const path = '/one.txt'
  await withSubs(async (subs) => {
    const v1 = origin.version(path)
    const client = await subscribed(subs, path)
    const raw = rawSubscribe({ port: proxy.port, path })
    subs.push(raw)
    await raw.waitForVersion(v1)

    const res = await put(path, { version: ['w1'], parents: [v1], patches: [{ unit: 'text', range: '[5:5]', content: ', dear' }] })
    assert.equal(res.status, 200, res.text)
    assert.equal(origin.text(path), 'hello, dear world', 'the origin holds the whole patched body')
    const [seen] = puts(path)
    assert.equal(seen.headers['if-match'], `"${v1}"`, 'the PUT is conditional on the version patched')
    assert.equal(seen.headers['content-range'], undefined, 'no Content-Range reaches the plain origin')
    assert.equal(res.headers.get('version'), '"w1"', "the writer's version is kept")
    assert.equal(res.headers.get('current-version'), '"w1"')

    await client.waitForVersion('w1')
    await raw.waitForVersion('w1')
    assert.equal(client.text, origin.text(path))
    assert.equal(raw.text, origin.text(path))
    const update = client.updates.at(-1)
    assert.ok(!isSnapshot(update), 'the subscriber gets a patch, not a snapshot')
    assert.deepEqual(update.parents, [v1])
    assert.deepEqual(
      update.patches.map((p) => [p.unit, p.range, Buffer.from(p.content).toString('utf8')]),
      [['text', '[5:5]', ', dear']],
      "the writer's patch as sent",
    )
    const wire = raw.updates.at(-1)
    assert.equal(wire.headers['content-range'], 'text [5:5]', 'Content-Range on the wire')
    assert.equal(wire.body, undefined, 'no snapshot body on the wire')
  })
})

test('braid-http PUT with several patches (Patches: N) in code points', async () => {
  const { origin } = ctx
  const path = '/many.txt'
  await withSubs(async (subs) => {
    const v1 = origin.version(path)
    const client = await subscribed(subs, path)
    const text = origin.text(path)
    const wave = codePoints(text.slice(0, text.indexOf('👋')))
    const patches = [
      { unit: 'text', range: '[0:5]', content: 'Hallo' },
      { unit: 'text', range: `[${wave}:${wave + 1}]`, content: '🖐🏽' },
      { unit: 'text', range: `[${codePoints(text)}:${codePoints(text)}]`, content: '!' },
    ]
    const res = await put(path, { version: ['w-many'], parents: [v1], patches })
    assert.equal(res.status, 200, res.text)
    assert.equal(origin.text(path), 'Hallo, wörld! 🖐🏽 bye!')
    await client.waitForVersion('w-many')
    assert.equal(client.text, origin.text(path))
    const update = client.updates.at(-1)
    assert.equal(update.patches?.length, 3, 'three patches, as written')
  })
})

test('concurrent writers on one parent: one wins, the rest get 409, subscribers end at the origin body', async () => {
  const { origin } = ctx
  const path = '/race.txt'
  await withSubs(async (subs) => {
    const v1 = origin.version(path)
    const a = await subscribed(subs, path)
    const b = await subscribed(subs, path)
    const writers = [0, 1, 2, 3, 4].map((i) =>
      put(path, { version: [`r${i}`], parents: [v1], patches: [{ unit: 'text', range: '[4:4]', content: ` ${i}` }] }),
    )
    const answers = await Promise.all(writers)
    const won = answers.flatMap((r, i) => (r.status === 200 ? [i] : []))
    assert.equal(won.length, 1, `exactly one writer wins: ${answers.map((r) => r.status)}`)
    for (const r of answers.filter((r) => r.status !== 200)) {
      assert.equal(r.status, 409, r.text)
      assert.ok(r.headers.get('current-version'), '409 names the current version')
    }
    assert.equal(origin.text(path), `base ${won[0]}`)
    for (const s of [a, b]) {
      await s.waitForVersion(`r${won[0]}`)
      assert.equal(s.text, origin.text(path), 'the subscriber reconstructs the origin body')
    }
    // The losers can rebase on the Current-Version they were given.
    const loser = answers.findIndex((r) => r.status === 409)
    const current = JSON.parse('[' + answers[loser].headers.get('current-version') + ']')
    const retry = await put(path, { parents: current, patches: [{ unit: 'text', range: '[0:0]', content: '>' }] })
    assert.equal(retry.status, 200, retry.text)
    assert.equal(origin.text(path), `>base ${won[0]}`)
    await a.waitForUpdates(3)
    assert.equal(a.text, origin.text(path))
  })
})

test('bad patches are refused with a one-line reason and never reach the origin', async () => {
  const { origin } = ctx
  const path = '/bad.txt'
  const v1 = origin.version(path)
  const cases = [
    ['range past the end', { parents: [v1], patches: [{ unit: 'text', range: '[5:99]', content: 'x' }] }, 416],
    ['unknown unit', { parents: [v1], patches: [{ unit: 'lines', range: '[0:1]', content: 'x' }] }, 400],
    ['json unit', { parents: [v1], patches: [{ unit: 'json', range: '.a', content: '1' }] }, 400],
    ['stale parents', { parents: ['nope'], patches: [{ unit: 'text', range: '[0:0]', content: 'x' }] }, 409],
    ['no parents', { patches: [{ unit: 'text', range: '[0:0]', content: 'x' }] }, 428],
  ]
  for (const [what, opts, status] of cases) {
    const res = await put(path, opts)
    assert.equal(res.status, status, `${what}: ${res.text}`)
    assert.equal(res.text.trim().split('\n').length, 1, `${what}: a one-line reason`)
  }
  assert.equal(puts(path).length, 0, 'no PUT reached the origin')
  assert.equal(origin.text(path), 'untouched')
})
