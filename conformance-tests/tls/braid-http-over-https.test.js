// The real braid-http client over HTTPS (issue 47). Run by tests/tls.rs,
// which makes the certificates with rcgen and sets BRAID_TLS_DIR (holding
// server.pem and server-key.pem) and NODE_EXTRA_CA_CERTS (their CA), so it
// is outside test/ and not part of `npm test`.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import path from 'node:path'
import { useProxy, withSubs } from '../lib/harness.js'
import { subscribe } from '../lib/client.js'
import { waitFor } from '../lib/util.js'

const dir = process.env.BRAID_TLS_DIR
if (!dir) throw new Error('BRAID_TLS_DIR is not set: run this file through `cargo test --test tls`')

const ctx = useProxy({
  seed: (o) => o.set('/notes.txt', 'Hello over TLS.\n'),
  args: ['--tls-cert', path.join(dir, 'server.pem'), '--tls-key', path.join(dir, 'server-key.pem')],
})

test('braid-http subscribes over HTTPS and follows changes', async () => {
  assert.match(ctx.proxy.url, /^https:\/\//)
  await withSubs(async (subs) => {
    const replica = await subscribe(`${ctx.proxy.url}/notes.txt`)
    subs.push(replica)
    assert.equal(replica.res.status, 209)
    await waitFor(() => replica.text === 'Hello over TLS.\n', 10000, { message: 'first version' })
    for (const text of ['Hello over TLS, again.\n', 'Changed. Hello over TLS, again!\n']) {
      ctx.origin.set('/notes.txt', text)
      await waitFor(() => (replica.check(), replica.text === text), 10000, {
        message: `replica at ${JSON.stringify(text)}; it has ${JSON.stringify(replica.text)}`,
      })
    }
    replica.check()
  })
})

test('a plain GET and a PUT through the TLS listener', async () => {
  const put = await fetch(`${ctx.proxy.url}/notes.txt`, { method: 'PUT', body: 'Written over TLS.\n' })
  assert.ok(put.ok, `PUT answered ${put.status}`)
  const get = await fetch(`${ctx.proxy.url}/notes.txt`)
  assert.equal(await get.text(), 'Written over TLS.\n')
})
