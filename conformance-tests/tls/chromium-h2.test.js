// Chromium over HTTPS holds more than six live subscriptions on one page
// with the project's own client and no multiplexer: over TLS the browser
// speaks h2, and HTTP/1.1's six connections per host no longer bound it
// (issue 47). Run by tests/tls.rs, which makes the certificates with rcgen
// and sets BRAID_TLS_DIR (server.pem, server-key.pem) and BRAID_TLS_SPKI
// (the base64 SHA-256 of the server key's SubjectPublicKeyInfo, which
// Chromium is told to accept), so it is outside test/ and not part of
// `npm test`.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import path from 'node:path'
import { startProxy } from '../lib/proxy.js'
import { chromiumDriver, CHROMIUM, CHROMIUM_ARGS, recordConsole } from '../lib/browser.js'

const dir = process.env.BRAID_TLS_DIR
const spki = process.env.BRAID_TLS_SPKI
if (!dir || !spki) throw new Error('BRAID_TLS_DIR and BRAID_TLS_SPKI are not set: run this file through `cargo test --test tls`')

const SUBSCRIPTIONS = 10

test(`Chromium holds ${SUBSCRIPTIONS} live subscriptions over h2`, async () => {
  // The demo origin: its /clock changes every second.
  const proxy = await startProxy({
    pollInterval: '100ms',
    args: ['--tls-cert', path.join(dir, 'server.pem'), '--tls-key', path.join(dir, 'server-key.pem')],
  })
  const chromium = await chromiumDriver()
  const browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: [...CHROMIUM_ARGS, `--ignore-certificate-errors-spki-list=${spki}`],
  })
  const logs = []
  try {
    const page = await browser.newPage()
    recordConsole(page, logs)
    await page.goto(`${proxy.url}/`)
    const protocol = await page.evaluate(() => performance.getEntriesByType('navigation')[0].nextHopProtocol)
    assert.equal(protocol, 'h2')
    // Each subscription must see at least two clock ticks after all of
    // them were opened: they are all live at once.
    const counts = await page.evaluate(
      (n) =>
        new Promise((resolve, reject) => {
          const updates = new Array(n).fill(0)
          const subs = []
          for (let i = 0; i < n; i++)
            subs.push(
              window.braidProxyClient.subscribe('/clock', {
                onUpdate: () => {
                  updates[i]++
                  if (updates.every((u) => u >= 3)) {
                    subs.forEach((s) => s.close())
                    resolve(updates)
                  }
                },
              }),
            )
          setTimeout(() => reject(new Error('updates per subscription: ' + updates.join(' '))), 20000)
        }),
      SUBSCRIPTIONS,
    )
    assert.equal(counts.length, SUBSCRIPTIONS)
  } catch (e) {
    e.message += `\n--- page console ---\n${logs.join('\n')}\n--- proxy output ---\n${proxy.output()}`
    throw e
  } finally {
    await browser.close()
    await proxy.stop()
  }
})
