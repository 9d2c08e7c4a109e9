// Starts the real braid-proxy binary ($BRAID_PROXY_BIN) and talks to its
// admin listener.

import { spawn } from 'node:child_process'
import fs from 'node:fs'
import http from 'node:http'
import { withTimeout } from './util.js'

const live = new Set()

// Last-resort cleanup: never leave a proxy process behind, even when a test
// file crashes or is interrupted.
function killAllSync() {
  for (const child of live) {
    try {
      child.kill('SIGKILL')
    } catch {}
  }
  live.clear()
}
process.on('exit', killAllSync)
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.once(sig, () => {
    killAllSync()
    process.exit(128 + (sig === 'SIGINT' ? 2 : sig === 'SIGTERM' ? 15 : 1))
  })
}

export function proxyBinary() {
  const bin = process.env.BRAID_PROXY_BIN
  if (!bin)
    throw new Error(
      'BRAID_PROXY_BIN is not set: point it at the braid-proxy binary, e.g. ' +
        'BRAID_PROXY_BIN=$PWD/target/debug/braid-proxy npm test --prefix conformance-tests',
    )
  let st
  try {
    st = fs.statSync(bin)
  } catch {
    throw new Error(`BRAID_PROXY_BIN=${bin} does not exist (build it with cargo build)`)
  }
  if (!st.isFile()) throw new Error(`BRAID_PROXY_BIN=${bin} is not a file`)
  try {
    fs.accessSync(bin, fs.constants.X_OK)
  } catch {
    throw new Error(`BRAID_PROXY_BIN=${bin} is not executable`)
  }
  return bin
}

/**
 * Starts the proxy in front of `upstream` (without one: its demo origin).
 * opts: {upstream, listen = '127.0.0.1:0', pollInterval = '100ms', heartbeat, args: [...extra], cwd, env, readyTimeoutMs = 20000}
 */
export async function startProxy(opts) {
  const bin = proxyBinary()
  const args = [
    '--listen', opts.listen ?? '127.0.0.1:0',
    '--admin-listen', '127.0.0.1:0',
    '--poll-interval', opts.pollInterval ?? '100ms',
  ]
  if (opts.upstream) args.push('--upstream', opts.upstream)
  if (opts.heartbeat) args.push('--heartbeat', opts.heartbeat)
  if (opts.args) args.push(...opts.args)

  const child = spawn(bin, args, {
    stdio: ['ignore', 'pipe', 'pipe'],
    cwd: opts.cwd,
    env: { RUST_LOG: 'warn', ...(opts.env ?? process.env), RUST_BACKTRACE: '1' },
  })
  live.add(child)

  const verbose = !!process.env.BRAID_CONFORMANCE_VERBOSE
  let output = '' // last 64 KiB of stdout+stderr, for failure messages
  const remember = (s) => {
    output = (output + s).slice(-65536)
  }
  let exited = null
  const exitPromise = new Promise((resolve) => {
    child.once('exit', (code, signal) => {
      exited = { code, signal }
      live.delete(child)
      resolve(exited)
    })
  })

  let listenUrl = null
  let adminUrl = null
  let stdoutBuf = ''
  let onReady
  const ready = new Promise((resolve, reject) => {
    onReady = { resolve, reject }
  })
  const checkReady = () => listenUrl && adminUrl && onReady.resolve()

  child.stdout.setEncoding('utf8')
  child.stdout.on('data', (s) => {
    remember(s)
    if (verbose) process.stderr.write(`[proxy stdout] ${s}`)
    stdoutBuf += s
    let nl
    while ((nl = stdoutBuf.indexOf('\n')) >= 0) {
      const line = stdoutBuf.slice(0, nl)
      stdoutBuf = stdoutBuf.slice(nl + 1)
      let m
      if ((m = /braid-proxy listening on (https?:\/\/[0-9.]+:\d+)/.exec(line))) listenUrl = m[1]
      if ((m = /braid-proxy admin listening on (http:\/\/[0-9.]+:\d+)/.exec(line))) adminUrl = m[1]
      checkReady()
    }
  })
  child.stderr.setEncoding('utf8')
  child.stderr.on('data', (s) => {
    remember(s)
    if (verbose) process.stderr.write(`[proxy stderr] ${s}`)
  })
  child.once('error', (e) => onReady.reject(new Error(`cannot start ${bin}: ${e.message}`)))
  exitPromise.then(({ code, signal }) =>
    onReady.reject(
      new Error(`braid-proxy exited before it was ready (code ${code}, signal ${signal}); args: ${args.join(' ')}\n--- output ---\n${output}`),
    ),
  )

  // SIGTERM, then SIGKILL after 5 s; the result has `forced: true` if the
  // proxy had to be killed.
  const stop = async () => {
    if (exited) return exited
    child.kill('SIGTERM')
    let timer
    const r = await Promise.race([exitPromise, new Promise((res) => (timer = setTimeout(() => res(null), 5000)))])
    clearTimeout(timer)
    if (r) return r
    child.kill('SIGKILL')
    return { ...(await exitPromise), forced: true }
  }

  try {
    await withTimeout(
      ready,
      opts.readyTimeoutMs ?? 20000,
      `braid-proxy did not print both "braid-proxy listening on http://..." and ` +
        `"braid-proxy admin listening on http://..." on stdout; args: ${args.join(' ')}\n--- output so far ---\n${output}`,
    )
  } catch (e) {
    await stop()
    throw e
  }

  const port = Number(new URL(listenUrl).port)
  const proxy = {
    url: listenUrl,
    adminUrl,
    port,
    host: '127.0.0.1',
    args,
    child,
    get exited() {
      return exited
    },
    output: () => output,
    stop,

    /** Raw /metrics text. */
    async metricsText() {
      const r = await request(`${adminUrl}/metrics`)
      if (r.status !== 200) throw new Error(`GET /metrics -> ${r.status}`)
      return r.body.toString('utf8')
    },
    /** Parsed /metrics: {name: value}, values of one name summed over label sets. */
    async metrics() {
      return parseMetrics(await proxy.metricsText())
    },
    /** One metric; throws if the proxy does not expose it. */
    async metric(name) {
      const m = await proxy.metrics()
      if (!(name in m)) throw new Error(`metric ${name} missing from /metrics`)
      return m[name]
    },
    /** POST /refresh?path=... on the admin listener. */
    async refresh(path) {
      const r = await request(`${adminUrl}/refresh?path=${encodeURIComponent(path)}`, { method: 'POST' })
      if (r.status < 200 || r.status > 299) throw new Error(`POST /refresh?path=${path} -> ${r.status}: ${r.body}`)
      return r
    },
  }
  return proxy
}

export function parseMetrics(text) {
  const out = {}
  for (const raw of text.split('\n')) {
    const line = raw.trim()
    if (!line || line.startsWith('#')) continue
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line)
    if (!m) continue
    const v = Number(m[3])
    out[m[1]] = (out[m[1]] ?? 0) + v
  }
  return out
}

/** Minimal one-shot HTTP request over a fresh loopback connection. */
export function request(url, { method = 'GET', headers = {}, body, timeoutMs = 10000 } = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method, headers, agent: false }, (res) => {
      const chunks = []
      res.on('data', (c) => chunks.push(c))
      res.on('end', () => {
        clearTimeout(timer)
        resolve({ status: res.statusCode, headers: res.headers, rawHeaders: res.rawHeaders, body: Buffer.concat(chunks) })
      })
      res.on('error', reject)
    })
    const timer = setTimeout(() => req.destroy(new Error(`${method} ${url}: no complete response in ${timeoutMs} ms`)), timeoutMs)
    req.on('error', (e) => {
      clearTimeout(timer)
      reject(e)
    })
    req.end(body)
  })
}
