// Shared scenario for tests 01 (text/plain) and 02 (application/json):
// subscribe through the proxy, change the origin step by step (directly or
// with a PUT through the proxy), and check after every step that the client's
// replica equals the origin.

import assert from 'node:assert/strict'
import { subscribe, braidFetch, isSnapshot } from './client.js'
import { withSubs } from './harness.js'

export async function putThroughProxy(proxy, path, body, contentType) {
  const res = await braidFetch(proxy.url + path, {
    method: 'PUT',
    body,
    headers: { 'content-type': contentType },
  })
  assert.ok(res.ok, `PUT ${path} through the proxy answered ${res.status}`)
  await res.arrayBuffer()
  return res
}

/**
 * edits: [{via: 'direct' | 'put', edit: (text) => newText, note}]
 * Returns the replica's updates.
 */
export async function runSyncScenario(ctx, { path, contentType, edits, check }) {
  const { origin, proxy } = ctx
  return withSubs(async (subs) => {
    const client = await subscribe(proxy.url + path)
    subs.push(client)

    const versions = [origin.version(path)]
    await client.waitForVersion(versions[0])
    assert.equal(client.text, origin.text(path), 'initial snapshot equals the origin body')

    for (const [i, step] of edits.entries()) {
      const next = step.edit(origin.text(path))
      assert.notEqual(next, origin.text(path), `edit ${i} must change the body`)
      if (step.via === 'put') await putThroughProxy(proxy, path, next, contentType)
      else origin.set(path, next)
      const v = origin.version(path)
      versions.push(v)
      await client.waitForVersion(v)
      assert.equal(client.text, origin.text(path), `after edit ${i} (${step.via}: ${step.note}) the replica equals the origin`)
      if (check) check(client.text)
    }

    const u = client.updates
    assert.equal(u.length, edits.length + 1, `one snapshot plus one update per change (got ${u.length} updates)`)
    assert.ok(isSnapshot(u[0]), 'the first update is a snapshot (body, no patches)')
    assert.deepEqual(u[0].version, [versions[0]], "the snapshot's Version is the origin's ETag")
    for (let i = 1; i < u.length; i++) {
      assert.deepEqual(u[i].version, [versions[i]], `update ${i}: Version is the origin's ETag`)
      assert.deepEqual(u[i].parents, [versions[i - 1]], `update ${i}: Parents is the previous version`)
      assert.ok(u[i].patches?.length > 0, `update ${i}: a small edit arrives as patches, not a snapshot`)
      for (const p of u[i].patches)
        assert.equal(p.unit, 'text', `update ${i}: ${contentType} patches use the text unit (code points)`)
      assert.ok(!u[i].status || u[i].status === '200', `update ${i}: status ${u[i].status}`)
    }
    return u
  })
}
