// 18. The operator's page: GET / on the admin listener, in headless
// Chromium. The binary runs with its demo origin; the demo page (three
// subscriptions) and two raw subscribers to /notes.txt are open, so the
// page must list /notes.txt as a polled resource with 3 subscribers, and
// follow the count live when one raw subscriber leaves. /status is the
// JSON the page polls. With BRAID_OPERATOR_SCREENSHOT=FILE the test saves
// a screenshot of the page there (docs/operator-page.png is one).

import { test } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { startProxy, request } from '../lib/proxy.js'
import { rawSubscribe } from '../lib/raw.js'
import { waitFor } from '../lib/util.js'
import { launchChromium, recordConsole } from '../lib/browser.js'

test('the operator page shows a subscribed resource and its subscribers, live', { timeout: 120000 }, async () => {
  const empty = fs.mkdtempSync(path.join(os.tmpdir(), 'braid-proxy-admin-'))
  const proxy = await startProxy({ cwd: empty })
  const raws = []
  let browser
  try {
    const page = await request(`${proxy.adminUrl}/`)
    assert.equal(page.status, 200)
    assert.match(page.headers['content-type'], /^text\/html/)
    // Self-contained: nothing is loaded from anywhere else.
    assert.doesNotMatch(page.body.toString(), /<(script|link|img)[^>]+(src|href)=/i)

    browser = await launchChromium()
    const logs = []
    const demo = await (await browser.newContext()).newPage()
    recordConsole(demo, logs)
    await demo.goto(`${proxy.url}/`)
    for (let i = 0; i < 2; i++) {
      const sub = rawSubscribe({ port: proxy.port, path: '/notes.txt' })
      raws.push(sub)
      await sub.waitForHead()
    }
    await waitFor(() => demo.evaluate(() => window.braidDemo.subs.every((s) => s.state === 'live')), 30000, {
      message: () => `the demo page's subscriptions are not live\n${logs.join('\n')}`,
    })

    const admin = await (await browser.newContext({ viewport: { width: 1200, height: 900 } })).newPage()
    recordConsole(admin, logs)
    await admin.goto(`${proxy.adminUrl}/`)
    const row = (p) => admin.evaluate((p) => {
      const tr = [...document.querySelectorAll('#resources tr')].find((r) => r.dataset.path === p)
      return tr ? [...tr.cells].map((c) => c.textContent) : null
    }, p)
    let last = null
    const explain = () => `row: ${JSON.stringify(last)}\npage: ${logs.slice(-10).join('\n')}`
    const shows = (subscribers) => async () => {
      last = await row('/notes.txt')
      return last && last[1] === 'poll' && last[3] === String(subscribers) && /^"d\d+"$/.test(last[2])
    }
    await waitFor(shows(3), 15000, { interval: 100, message: () => `no /notes.txt row with 3 subscribers\n${explain()}` })
    assert.match(last[5], /^\d+(\.\d)? s$/, explain()) // polled every
    assert.match(last[6], /polled .* ago/, explain())
    assert.equal(await admin.textContent('#upstream-health'), 'healthy')
    // Deliveries per second need two readings; the clock ticks every second.
    await waitFor(async () => Number(await admin.textContent('#deliveries')) > 0, 10000, {
      interval: 200, message: () => `no deliveries per second shown\n${explain()}`,
    })
    assert.match(await admin.textContent('#memory'), /--state-bytes/)

    // Live: a subscriber leaves, and the next reading shows it.
    raws.pop().close()
    await waitFor(shows(2), 10000, { interval: 100, message: () => `the count did not follow\n${explain()}` })

    const status = JSON.parse((await request(`${proxy.adminUrl}/status`)).body.toString())
    const notes = status.resources.find((r) => r.path === '/notes.txt')
    assert.equal(notes.subscribers, 2)
    assert.equal(notes.feed, 'poll')

    const shot = process.env.BRAID_OPERATOR_SCREENSHOT
    if (shot) await admin.screenshot({ path: shot, fullPage: true })
  } finally {
    for (const sub of raws) sub.close()
    await browser?.close().catch(() => {})
    await proxy.stop()
    fs.rmSync(empty, { recursive: true, force: true })
  }
})
