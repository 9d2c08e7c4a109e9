// Runs mnot's HTTP caching test suite (npm `http-cache-tests`, the suite of
// https://cache-tests.fyi, RFC 9111) through braid-proxy, or through any
// other proxy given by base URL. Loopback only; every wait is bounded.
//
//   BRAID_PROXY_BIN=target/release/braid-proxy node conformance-tests/cache-tests/run.mjs
//
// Starts the suite's origin server (origin.mjs) on 127.0.0.1, then
// braid-proxy with `--listen 127.0.0.1:0 --upstream http://127.0.0.1:<origin>`,
// runs every test of the suite through the proxy, writes the results
// (test id -> true | [error name, message], the cache-tests.fyi format) and
// prints a summary.
//
// env:
//   BRAID_PROXY_BIN          the proxy binary (required unless CACHE_TESTS_BASE is set)
//   CACHE_TESTS_PROXY_ARGS   extra proxy arguments, split on spaces
//   CACHE_TESTS_PEER         set: the base is another cache, not a Braid server (no Braid check)
//   CACHE_TESTS_BASE         run against this base URL (e.g. http://127.0.0.1:8081,
//                            a peer proxy whose upstream is the origin) instead of
//                            starting braid-proxy; `direct` runs against the origin itself
//   CACHE_TESTS_ORIGIN_PORT  port of the origin server (default: a free one; set it
//                            when a peer's config names the origin's port)
//   CACHE_TESTS_RESULTS      results JSON path (default target/cache-tests-results.json)
//   CACHE_TESTS_FLOOR        exit 1 if fewer tests pass than this (default 0)
//   CACHE_TESTS_ID           run only this test, dumping its requests and responses
//   CACHE_TESTS_TIMEOUT      overall time limit in seconds (default 240)
//   CACHE_TESTS_VERBOSE=1    echo the origin's and the proxy's output
//
// Exit status: 0 if at least CACHE_TESTS_FLOOR tests passed, 1 if fewer,
// 2 on a setup error (origin or proxy did not start, timeout).

import { spawn } from 'node:child_process'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import process from 'node:process'
import { fileURLToPath } from 'node:url'

import fetch from 'node-fetch'
import { runTests, getResults } from 'http-cache-tests/client/runner.mjs'
import suites from 'http-cache-tests/tests/index.mjs'
import surrogate from 'http-cache-tests/tests/surrogate-control.mjs'

const here = path.dirname(fileURLToPath(import.meta.url))
const repoRoot = path.resolve(here, '..', '..')

const env = process.env
const timeoutSecs = Number(env.CACHE_TESTS_TIMEOUT || 240)
const floor = Number(env.CACHE_TESTS_FLOOR || 0)
const resultsPath = path.resolve(env.CACHE_TESTS_RESULTS || path.join(repoRoot, 'target', 'cache-tests-results.json'))
const verbose = env.CACHE_TESTS_VERBOSE === '1'
const onlyId = env.CACHE_TESTS_ID || ''
// No single request of the suite should take long; a hung one becomes a
// harness failure of its test instead of stalling the run.
const REQUEST_TIMEOUT_MS = 20000
const START_TIMEOUT_MS = 20000

if (!Number.isInteger(floor) || floor < 0) fail(`CACHE_TESTS_FLOOR must be a non-negative integer, not ${env.CACHE_TESTS_FLOOR}`)

const children = []
const logDir = fs.mkdtempSync(path.join(os.tmpdir(), 'braid-cache-tests-'))

function killChildren () {
  for (const child of children) {
    if (child.exitCode === null && child.signalCode === null) {
      try { child.kill('SIGKILL') } catch {}
    }
  }
}
process.on('exit', killChildren)
for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.on(signal, () => { console.error(`cache-tests: ${signal}, stopping`); process.exit(2) })
}
const overall = setTimeout(() => fail(`did not finish within ${timeoutSecs} s`), timeoutSecs * 1000)
overall.unref()

function fail (message) {
  console.error(`cache-tests: ${message}`)
  console.error(`cache-tests: logs in ${logDir}`)
  process.exit(2)
}

// Starts `cmd`, logs its output to logDir/<name>.log, resolves with the
// first match of `pattern` in its stdout.
function start (name, cmd, args, options, pattern) {
  return new Promise((resolve, reject) => {
    const log = fs.createWriteStream(path.join(logDir, `${name}.log`))
    const child = spawn(cmd, args, { ...options, stdio: ['ignore', 'pipe', 'pipe'] })
    children.push(child)
    let seen = ''
    let found = false
    const timer = setTimeout(() => reject(new Error(`${name} did not start within ${START_TIMEOUT_MS} ms`)), START_TIMEOUT_MS)
    child.on('error', err => { clearTimeout(timer); reject(new Error(`cannot start ${name} (${cmd}): ${err.message}`)) })
    child.on('exit', (code, signal) => {
      clearTimeout(timer)
      if (!found) reject(new Error(`${name} exited (${signal || code}) before it was ready: ${seen.slice(-2000)}`))
      else if (!shuttingDown) console.error(`cache-tests: ${name} exited (${signal || code}) during the run`)
    })
    for (const stream of [child.stdout, child.stderr]) {
      stream.on('data', chunk => {
        log.write(chunk)
        if (verbose) process.stderr.write(`[${name}] ${chunk}`)
        if (!found) {
          seen += chunk.toString()
          const match = seen.match(pattern)
          if (match) { found = true; clearTimeout(timer); resolve(match) }
        }
      })
    }
  })
}
let shuttingDown = false

async function startOrigin () {
  const port = env.CACHE_TESTS_ORIGIN_PORT || '0'
  const match = await start('origin', process.execPath, [path.join(here, 'origin.mjs')], {
    cwd: here,
    env: { ...env, npm_config_port: port, npm_config_pidfile: path.join(logDir, 'origin.pid') }
  }, /Listening on http:\/\/127\.0\.0\.1:(\d+)\//)
  return `http://127.0.0.1:${match[1]}`
}

async function startProxy (origin) {
  const bin = env.BRAID_PROXY_BIN
  if (!bin) fail('set BRAID_PROXY_BIN to the braid-proxy binary (or CACHE_TESTS_BASE to a base URL)')
  const extra = (env.CACHE_TESTS_PROXY_ARGS || '').split(' ').filter(Boolean)
  const match = await start('proxy', path.resolve(bin),
    ['--listen', '127.0.0.1:0', '--upstream', origin, ...extra],
    { cwd: repoRoot, env }, /braid-proxy listening on http:\/\/(\S+)/)
  return `http://${match[1]}`
}

function allTests () {
  // cli.mjs of the package runs index.mjs plus the Surrogate-Control suite: 350 tests.
  const all = [...suites, surrogate]
  if (!onlyId) return all
  for (const suite of all) {
    const test = suite.tests.find(t => t.id === onlyId)
    if (test) {
      test.dump = true
      return [{ ...suite, tests: [test] }]
    }
  }
  fail(`no test has id ${onlyId}`)
}

function classify (test, result) {
  if (result === true) return 'pass'
  if (result === undefined) return 'untested'
  if (Array.isArray(result) && result[0] === 'Setup') return result[1] === 'retry' ? 'retry' : 'setup fail'
  if (!Array.isArray(result) || result[0] !== 'Assertion') return 'harness fail'
  if (test.kind === 'optimal') return 'optional fail'
  if (test.kind === 'check') return 'check: no'
  return 'fail'
}

function isRequired (test) {
  return test.kind === undefined || test.kind === 'required'
}

function plain (markdown) {
  return markdown.replace(/`/g, '').replace(/\s+/g, ' ').trim()
}

function summarize (testSuites, results, target) {
  const tests = testSuites.flatMap(s => s.tests.filter(t => t.browser_only !== true))
  const passed = tests.filter(t => results[t.id] === true)
  const required = tests.filter(isRequired)
  const requiredPassed = required.filter(t => results[t.id] === true)
  const kinds = {}
  const classes = {}
  for (const t of tests) {
    const kind = t.kind || 'required'
    kinds[kind] = kinds[kind] || [0, 0]
    kinds[kind][1]++
    if (results[t.id] === true) kinds[kind][0]++
    const c = classify(t, results[t.id])
    classes[c] = (classes[c] || 0) + 1
  }
  console.log(`cache-tests (http-cache-tests 0.4.5) through ${target}`)
  console.log(`passed ${passed.length}/${tests.length} (all tests)`)
  console.log(`passed ${requiredPassed.length}/${required.length} (required: kind 'required' or no kind)`)
  console.log('by kind: ' + Object.entries(kinds).map(([k, [p, n]]) => `${k} ${p}/${n}`).join(', '))
  console.log('by result: ' + Object.entries(classes).map(([c, n]) => `${c} ${n}`).join(', '))
  const failed = tests.filter(t => results[t.id] !== true)
  if (failed.length) {
    console.log(`failed (${failed.length}):`)
    const order = t => isRequired(t) ? 0 : t.kind === 'optimal' ? 1 : 2
    failed.sort((a, b) => order(a) - order(b))
    for (const t of failed) {
      const r = results[t.id]
      const why = Array.isArray(r) ? `${r[0]}: ${r[1]}` : String(r)
      console.log(`  [${t.kind || 'required'}] ${t.id}: ${plain(t.name).slice(0, 90)} -- ${why.slice(0, 160)}`)
    }
  }
  return passed.length
}

// Before the suite, the proxy serves a Braid server's answers (origin.mjs's
// /__braid/doc): a subscription's first update, then a plain GET twice.
// The suite then runs on a proxy that has seen Braid headers.
async function braidFirst (base) {
  const url = `${base}/__braid/doc`
  const controller = new AbortController()
  const sub = await fetch(url, { headers: { subscribe: 'true' }, signal: controller.signal, timeout: REQUEST_TIMEOUT_MS })
  if (sub.status !== 209) fail(`the Braid resource's subscription got ${sub.status}, not 209`)
  for await (const chunk of sub.body) {
    if (chunk.toString().includes('braid')) break
  }
  controller.abort()
  for (let i = 0; i < 2; i++) {
    const res = await fetch(url, { timeout: REQUEST_TIMEOUT_MS })
    const text = await res.text()
    if (res.status !== 200 || text !== 'braid' || res.headers.get('version') !== '"b1"') {
      fail(`the Braid resource's GET got ${res.status} ${JSON.stringify(text)} version ${res.headers.get('version')}`)
    }
    // Its versioned answer is stored like any other (max-age=60).
    if (i === 1 && !/; hit/.test(res.headers.get('cache-status') || '')) {
      fail(`the Braid resource's second GET was not a hit: ${res.headers.get('cache-status')}`)
    }
  }
  console.error('cache-tests: the proxy served a Braid resource first (a subscription and two GETs)')
}

async function main () {
  let base
  let origin
  if (env.CACHE_TESTS_BASE === 'direct') {
    base = origin = await startOrigin()
  } else if (env.CACHE_TESTS_BASE) {
    base = env.CACHE_TESTS_BASE.replace(/\/+$/, '')
    if (env.CACHE_TESTS_ORIGIN_PORT) origin = await startOrigin()
  } else {
    origin = await startOrigin()
    base = await startProxy(origin)
  }
  console.error(`cache-tests: base ${base}, origin ${origin || '(not started here)'}, logs in ${logDir}`)

  // A peer that is no Braid server (nginx proxy_cache, Varnish) is not asked the Braid check.
  if (origin && base !== origin && !env.CACHE_TESTS_PEER) await braidFirst(base)
  const testSuites = allTests()
  const timedFetch = (url, init) => fetch(url, { ...init, timeout: REQUEST_TIMEOUT_MS })
  const began = Date.now()
  await runTests(testSuites, timedFetch, false, base)
  const results = getResults()
  const secs = ((Date.now() - began) / 1000).toFixed(1)

  fs.mkdirSync(path.dirname(resultsPath), { recursive: true })
  fs.writeFileSync(resultsPath, JSON.stringify(results, null, 2) + '\n')
  const passed = summarize(testSuites, results, env.CACHE_TESTS_BASE ? base : `braid-proxy ${base}`)
  console.log(`ran in ${secs} s; results in ${resultsPath}`)

  shuttingDown = true
  killChildren()
  if (passed < floor) {
    console.log(`FAIL: ${passed} tests passed, fewer than the floor CACHE_TESTS_FLOOR=${floor}`)
    process.exit(1)
  }
  console.log(`ok: ${passed} passed >= floor ${floor}`)
  fs.rmSync(logDir, { recursive: true, force: true })
  process.exit(0)
}

main().catch(err => fail(err.stack || String(err)))
