// 20. A credential that stops working, with braid-http's own `retry`: the
// proxy sends the origin's 401 as the subscriber's last update and ends its
// stream; braid-http reconnects once (it retries a stream that ends), gets
// the origin's 401 as a plain answer, and gives up ("access denied") instead
// of reconnecting for ever with a dead credential. The origin hears that
// credential a bounded number of times; /readyz stays 200.

import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { startProxy, request } from '../lib/proxy.js'
import { braidFetch } from '../lib/client.js'
import { sleep, waitFor } from '../lib/util.js'

const REFUSED = 'token expired or revoked'
const procs = []
let server
after(async () => {
  for (const p of procs) await p.stop()
  server?.close()
})

test('an expired credential is told once, and braid-http gives up', { timeout: 60000 }, async () => {
  let valid = true
  let asked = 0
  server = http.createServer((req, res) => {
    if (req.headers.authorization === 'Bearer tokenA') asked++
    if (valid && req.headers.authorization === 'Bearer tokenA') {
      res.writeHead(200, { 'content-type': 'text/plain', 'cache-control': 'private' })
      res.end('secret v1')
    } else {
      res.writeHead(401, { 'content-type': 'text/plain', 'www-authenticate': 'Bearer error="invalid_token"' })
      res.end(REFUSED)
    }
  })
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
  const proxy = await startProxy({ upstream: `http://127.0.0.1:${server.address().port}` })
  procs.push(proxy)

  const updates = []
  const errors = []
  const ac = new AbortController()
  const res = await braidFetch(`${proxy.url}/authz`, {
    subscribe: true,
    retry: true,
    signal: ac.signal,
    headers: { authorization: 'Bearer tokenA' },
  })
  assert.equal(res.status, 209)
  res.subscribe((u) => updates.push(u), (e) => errors.push(e))
  try {
    await waitFor(() => updates.some((u) => u.body_text === 'secret v1'), 10000)
    valid = false
    const before = asked
    await waitFor(() => updates.some((u) => u.status === '401'), 5000, {
      message: 'the 401 reached the subscriber as an update',
    })
    const denial = updates.find((u) => u.status === '401')
    assert.equal(denial.body_text, REFUSED, 'the update carries the origin\'s 401 body')
    // The stream ends; braid-http reconnects after 1 s and gives up on the 401.
    await waitFor(() => errors.length > 0, 10000, { message: 'braid-http surfaced the denial' })
    assert.match(String(errors[0]?.message ?? errors[0]), /401/)
    await sleep(4000)
    const after = asked - before
    console.log(`origin asked ${after} times with the dead credential after it expired`)
    // The poll that was refused, and the one reconnection's request.
    assert.ok(after <= 3, `the origin was asked ${after} times with the dead credential`)
    assert.equal(errors.length, 1)
    const ready = await request(`${proxy.adminUrl}/readyz`)
    assert.equal(ready.status, 200)
  } finally {
    ac.abort()
  }
})
